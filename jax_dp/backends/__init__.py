"""Ways to run a per-shard step over devices; each backend lives in its own file."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from jax_dp.backends.base import ALLREDUCES, BACKENDS, Backend, check_allreduce

if TYPE_CHECKING:
    import jax

__all__ = ["ALLREDUCES", "BACKENDS", "Backend", "check_allreduce", "make_backend"]


def make_backend(name: str, devices: Sequence[jax.Device]) -> Backend:
    """The backend called name over devices: one of BACKENDS, as TrainConfig (or the command
    that builds one) has checked."""
    from jax_dp.backends import jit, pmap, shard_map, single  # The backends load here.

    makers = {"single": single.Single, "pmap": pmap.Pmap, "shard_map": shard_map.ShardMap,
              "jit": jit.Jit}
    return makers[name](devices)
