"""jax-dp: data-parallel training in JAX, after Dive into Deep Learning's multi-GPU sections."""
