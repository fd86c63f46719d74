"""One device under jax.jit, with no collectives: the reference every backend must match."""

from __future__ import annotations

import jax
import numpy as np

from jax_dp.backends.base import Backend


class Single(Backend):
    """Runs whole global batches on one device."""
    name, axis_name = "single", None

    def __init__(self, devices):
        super().__init__(devices)
        if len(self.devices) != 1:
            raise ValueError(f"the single-device backend runs on 1 device, got {len(self.devices)}")

    def replicate(self, tree):
        return jax.device_put(tree, self.devices[0])

    shard = replicate

    def unreplicate(self, tree):
        return jax.tree.map(np.asarray, tree)

    def wrap(self, fn, donate_argnums=()):
        return jax.jit(fn, donate_argnums=donate_argnums)
