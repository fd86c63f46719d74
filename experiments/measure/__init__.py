"""Measurement and comparison for the experiments: timings, profiles, parity against one device,
the scaling experiment's runs, model, report and hardware profiles, the PyTorch peer, plots."""
