"""jax.shard_map over a one-axis Mesh: params replicated (P()), batches split (P(AXIS))."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jax_dp.backends.mesh import MeshBackend
from jax_dp.parallel import AXIS


class ShardMap(MeshBackend):
    """Runs the per-shard step under shard_map, as pmap runs it.

    Unlike pmap, nothing gains a device axis: state is one replicated array per leaf and
    a global batch [B, ...] is split along B.
    """
    name, axis_name = "shard_map", AXIS

    def wrap(self, fn, donate_argnums=()):
        def sharded(*args):  # Every argument replicated but the last, the batch.
            specs = (P(),) * (len(args) - 1) + (P(AXIS),)
            # check_vma=False: the step's values are per device, as under pmap, and its own
            # psums make them replicated. With shard_map's typing on, the gradient of
            # replicated params would arrive summed already, and the psum would count it k times.
            return jax.shard_map(fn, mesh=self.mesh, in_specs=specs, out_specs=P(),
                                 check_vma=False)(*args)
        return jax.jit(sharded, donate_argnums=donate_argnums)
