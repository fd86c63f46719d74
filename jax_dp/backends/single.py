"""One device under jax.jit, with no collectives: the reference every backend must match."""

from __future__ import annotations

import jax
import numpy as np

from jax_dp.backends import Backend


def make(devices: tuple[jax.Device, ...]) -> Backend:
    """A Backend that runs whole global batches on one device."""
    if len(devices) != 1:
        raise ValueError(f"the single-device backend runs on 1 device, got {len(devices)}")
    put = lambda tree: jax.device_put(tree, devices[0])
    to_host = lambda tree: jax.tree.map(np.asarray, tree)
    return Backend(
        name="single", devices=devices, axis_name=None, replicate=put, shard=put,
        unreplicate=to_host,
        compile=lambda fn, donate_argnums=(), replicated=2: jax.jit(fn, donate_argnums=donate_argnums),
        to_host=to_host, from_host=put)
