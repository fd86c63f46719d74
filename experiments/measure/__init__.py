"""Measurement and comparison: timings, profiles, parity against one device, a scaling model,
the PyTorch peer, plots. Nothing here is needed to train."""
