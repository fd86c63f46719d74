"""The book's way: jax.pmap over the devices, params replicated, batches split."""

from __future__ import annotations

import jax
import numpy as np

from jax_dp import parallel
from jax_dp.backends import Backend


def make(devices: tuple[jax.Device, ...]) -> Backend:
    """A Backend that pmaps a per-shard step over devices along parallel.AXIS.

    In a multi-process run, devices spans every process; each process places values on
    its own devices only and feeds them its slice of every global batch.
    """
    local = tuple(d for d in devices if d.process_index == jax.process_index())
    process, processes = jax.process_index(), len({d.process_index for d in devices})

    def shard(batch):
        size = len(jax.tree.leaves(batch)[0]) // processes
        mine = jax.tree.map(lambda x: x[process * size:(process + 1) * size], batch)
        return parallel.split_and_load(mine, local)

    return Backend(
        name="pmap", devices=devices, axis_name=parallel.AXIS,
        replicate=lambda tree: parallel.get_params(tree, local), shard=shard,
        unreplicate=parallel.unreplicate,
        compile=lambda fn, donate_argnums=(), replicated=2: jax.pmap(
            fn, axis_name=parallel.AXIS, devices=devices, donate_argnums=donate_argnums),
        to_host=lambda tree: jax.tree.map(np.asarray, tree),
        from_host=lambda tree: jax.device_put(tree, parallel.device_sharding(local)))
