"""jax.jit with NamedSharding: the single-device step, its batch sharded; XLA adds the all-reduce."""

from __future__ import annotations

import jax

from jax_dp.backends import Backend
from jax_dp.backends.mesh import placement


def make(devices: tuple[jax.Device, ...]) -> Backend:
    """A Backend that jits the whole-batch step (axis_name None) over sharded inputs.

    The step is written for one device; because the batch is sharded along AXIS and the
    state replicated, XLA's SPMD partitioner splits the work and inserts the all-reduces
    (gradient sums, BatchNorm statistics) itself.
    """
    place = placement(devices)

    def compile(fn, donate_argnums=(), replicated=2):
        return jax.jit(fn, in_shardings=(place.replicated,) * replicated + (place.split,),
                       out_shardings=place.replicated, donate_argnums=donate_argnums)

    return Backend(name="jit", devices=devices, axis_name=None, replicate=place.replicate,
                   shard=place.shard, unreplicate=place.to_host, compile=compile,
                   to_host=place.to_host, from_host=place.replicate)
