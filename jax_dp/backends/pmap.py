"""The book's way: jax.pmap over the devices, params replicated, batches split."""

from __future__ import annotations

import jax
import numpy as np

from jax_dp import parallel
from jax_dp.backends.base import Backend


class Pmap(Backend):
    """pmaps a per-shard step over the devices along parallel.AXIS.

    In a multi-process run, devices spans every process; each process places values on
    its own devices only and feeds them its slice of every global batch.
    """
    name, axis_name = "pmap", parallel.AXIS

    def __init__(self, devices):
        super().__init__(devices)
        self.processes = len({d.process_index for d in self.devices})

    def replicate(self, tree):
        return parallel.get_params(tree, self.local)

    def shard(self, batch):
        size, me = len(jax.tree.leaves(batch)[0]) // self.processes, jax.process_index()
        mine = jax.tree.map(lambda x: x[me * size:(me + 1) * size], batch)
        return parallel.split_and_load(mine, self.local)

    def unreplicate(self, tree):
        return parallel.unreplicate(tree)

    def to_host(self, tree):
        return jax.tree.map(np.asarray, tree)

    def from_host(self, tree):
        return jax.device_put(tree, parallel.device_sharding(self.local))

    def wrap(self, fn, donate_argnums=()):
        return jax.pmap(fn, axis_name=parallel.AXIS, devices=self.devices,
                        donate_argnums=donate_argnums)

    def compile(self, wrapped, *args):
        executable = wrapped.lower(*args).compile()
        # pmap's compiled form cannot take process-local arrays: keep the wrapped step,
        # which finds this executable in JAX's compilation cache.
        return wrapped if jax.process_count() > 1 else executable
