"""The book's way: jax.pmap over the devices, params replicated, batches split."""

from __future__ import annotations

import jax
import numpy as np

from jax_dp import parallel
from jax_dp.backends import Backend


def make(devices: tuple[jax.Device, ...]) -> Backend:
    """A Backend that pmaps a per-shard step over devices along parallel.AXIS."""
    return Backend(
        name="pmap", devices=devices, axis_name=parallel.AXIS,
        replicate=lambda tree: parallel.get_params(tree, devices),
        shard=lambda tree: parallel.split_and_load(tree, devices),
        unreplicate=parallel.unreplicate,
        compile=lambda fn, donate_argnums=(): jax.pmap(
            fn, axis_name=parallel.AXIS, devices=devices, donate_argnums=donate_argnums),
        to_host=lambda tree: jax.tree.map(np.asarray, tree),
        from_host=lambda tree: jax.device_put(tree, parallel.device_sharding(devices)))
