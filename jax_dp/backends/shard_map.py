"""jax.shard_map over a one-axis Mesh: params replicated (P()), batches split (P(AXIS)), typed collectives."""

from __future__ import annotations

import copy

import jax
from jax.sharding import PartitionSpec as P

from jax_dp.backends.mesh import MeshBackend
from jax_dp.parallel import AXIS


class ShardMap(MeshBackend):
    """Runs the per-shard step under shard_map with check_vma on.

    Unlike pmap, nothing gains a device axis: state is one replicated array per leaf and
    a global batch [B, ...] is split along B. shard_map types every value as invariant
    or varying over AXIS; the step differentiates a "reduced" view of the params so its
    gradients are "unreduced" partial sums that the explicit psum completes once.
    """
    name, axis_name = "shard_map", AXIS
    check_vma = True  # Type collectives' results (off for a step that knows its own).

    def for_steps(self, steps):
        if steps.typed:
            return self
        untyped = copy.copy(self)
        untyped.check_vma = False
        return untyped

    def compile(self, fn, donate_argnums=()):
        def run(*args):  # Every argument replicated but the last, the batch.
            specs = (P(),) * (len(args) - 1) + (P(AXIS),)
            return jax.shard_map(fn, mesh=self.mesh, in_specs=specs, out_specs=P(),
                                 check_vma=self.check_vma)(*args)
        return jax.jit(run, donate_argnums=donate_argnums)
