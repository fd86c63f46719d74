"""jax.shard_map over a one-axis Mesh: params replicated (P()), batches split (P(AXIS)), typed collectives."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jax_dp.backends import Backend
from jax_dp.backends.mesh import placement
from jax_dp.parallel import AXIS


def make(devices: tuple[jax.Device, ...]) -> Backend:
    """A Backend that runs the per-shard step under shard_map with check_vma on.

    Unlike pmap, nothing gains a device axis: state is one replicated array per leaf and
    a global batch [B, ...] is split along B. shard_map types every value as invariant
    or varying over AXIS; the step differentiates a "reduced" view of the params so its
    gradients are "unreduced" partial sums that the explicit psum completes once.
    """
    place = placement(devices)

    def compile(fn, donate_argnums=(), replicated=2):
        mapped = jax.shard_map(fn, mesh=place.mesh, in_specs=(P(),) * replicated + (P(AXIS),),
                               out_specs=P())
        return jax.jit(mapped, donate_argnums=donate_argnums)

    return Backend(name="shard_map", devices=devices, axis_name=AXIS, replicate=place.replicate,
                   shard=place.shard, unreplicate=place.to_host, compile=compile,
                   to_host=place.to_host, from_host=place.replicate)
