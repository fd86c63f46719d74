"""jax.shard_map over a one-axis Mesh: params replicated (P()), batches split (P(AXIS)), typed collectives."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_dp.backends import Backend
from jax_dp.parallel import AXIS


def make(devices: tuple[jax.Device, ...]) -> Backend:
    """A Backend that runs the per-shard step under shard_map with check_vma on.

    Unlike pmap, nothing gains a device axis: state is one replicated array per leaf and
    a global batch [B, ...] is split along B. shard_map types every value as invariant
    or varying over AXIS; the step differentiates a "reduced" view of the params so its
    gradients are "unreduced" partial sums that the explicit psum completes once.
    """
    mesh = Mesh(np.array(devices), (AXIS,))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    to_host = lambda tree: jax.tree.map(np.asarray, tree)
    replicate = lambda tree: jax.device_put(tree, replicated)

    def compile(fn, donate_argnums=()):
        mapped = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=P())
        return jax.jit(mapped, donate_argnums=donate_argnums)

    return Backend(name="shard_map", devices=devices, axis_name=AXIS, replicate=replicate,
                   shard=lambda tree: jax.device_put(tree, split), unreplicate=to_host,
                   compile=compile, to_host=to_host, from_host=replicate)
