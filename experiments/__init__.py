"""Thin runnable experiments over jax_dp: `python -m experiments.<name> --help`."""
