"""Placement on a one-axis Mesh, shared by the shard_map and jit backends; multi-process aware."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_dp.backends.base import Backend
from jax_dp.parallel import AXIS


class MeshBackend(Backend):
    """State replicated (P()) and batches split (P(AXIS)) over a Mesh of the devices, in order."""

    def __init__(self, devices):
        super().__init__(devices)
        self.mesh = Mesh(np.array(self.devices), (AXIS,))
        self.replicated, self.sharded = NamedSharding(self.mesh, P()), NamedSharding(self.mesh, P(AXIS))

    def replicate(self, tree: Any) -> Any:
        """Every leaf, whole, on every device (each process passes the same host values)."""
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
            self.replicated, np.asarray(x)), tree)

    def shard(self, batch: Any) -> Any:
        """A global batch [B, ...] split along B; each process feeds only its own rows."""
        processes, me = jax.process_count(), jax.process_index()

        def place(x):
            x = np.asarray(x)
            size = len(x) // processes
            return jax.make_array_from_process_local_data(self.sharded, x[me * size:(me + 1) * size],
                                                          x.shape)
        return jax.tree.map(place, batch)

    def unreplicate(self, tree: Any) -> Any:
        """A replicated tree on the host, read from this process's first device."""
        return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)
