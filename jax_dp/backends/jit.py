"""jax.jit with NamedSharding: the single-device step, its batch sharded; XLA adds the all-reduce."""

from __future__ import annotations

import jax

from jax_dp.backends.mesh import MeshBackend


class Jit(MeshBackend):
    """Jits the whole-batch step (axis_name None) over sharded inputs.

    The step is written for one device; because the batch is sharded along AXIS and the
    state replicated (the shardings the placed arguments carry), XLA's SPMD partitioner
    splits the work and inserts the all-reduces (gradient sums, BatchNorm statistics) itself.
    """
    name, axis_name = "jit", None

    def wrap(self, fn, donate_argnums=()):
        return jax.jit(fn, out_shardings=self.replicated, donate_argnums=donate_argnums)
