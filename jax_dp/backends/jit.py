"""jax.jit with NamedSharding: the single-device step, its batch sharded; XLA adds the all-reduce."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_dp.backends import Backend
from jax_dp.parallel import AXIS


def make(devices: tuple[jax.Device, ...]) -> Backend:
    """A Backend that jits the whole-batch step (axis_name None) over sharded inputs.

    The step is written for one device; because the batch is sharded along AXIS and the
    state replicated, XLA's SPMD partitioner splits the work and inserts the all-reduces
    (gradient sums, BatchNorm statistics) itself.
    """
    mesh = Mesh(np.array(devices), (AXIS,))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    to_host = lambda tree: jax.tree.map(np.asarray, tree)
    replicate = lambda tree: jax.device_put(tree, replicated)

    def compile(fn, donate_argnums=()):
        return jax.jit(fn, in_shardings=(replicated, replicated, split),
                       out_shardings=replicated, donate_argnums=donate_argnums)

    return Backend(name="jit", devices=devices, axis_name=None, replicate=replicate,
                   shard=lambda tree: jax.device_put(tree, split), unreplicate=to_host,
                   compile=compile, to_host=to_host, from_host=replicate)
