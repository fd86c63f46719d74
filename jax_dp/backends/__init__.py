"""Ways to run a per-shard step over devices; each backend lives in its own file."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax

from jax_dp.errors import ParamError

# pmap is the book's; single, one device with no collectives, is the reference.
BACKENDS = ("pmap", "shard_map", "jit", "single")


class Backend(NamedTuple):
    """How state and batches are placed on devices, and how a per-shard step is compiled.

    compile(fn, donate_argnums, replicated=2) takes fn(state, metrics, batch) written for
    one shard (collectives over `axis_name`), or any fn whose first `replicated` arguments
    are replicated and whose last is split, and returns the step to call on placed values.
    replicate puts one copy of a host tree on every device, unreplicate reads one copy
    back; to_host and from_host move a placed tree whole, every device's copy included.
    """
    name: str
    devices: tuple[jax.Device, ...]
    axis_name: str | None
    replicate: Callable[[Any], Any]
    shard: Callable[[Any], Any]
    unreplicate: Callable[[Any], Any]
    compile: Callable[..., Callable]
    to_host: Callable[[Any], Any]
    from_host: Callable[[Any], Any]


def make_backend(name: str, devices: Sequence[jax.Device]) -> Backend:
    """The backend called name ('single', 'pmap', 'shard_map', 'jit') over devices."""
    from jax_dp.backends import jit, pmap, shard_map, single

    makers = {"single": single.make, "pmap": pmap.make, "shard_map": shard_map.make,
              "jit": jit.make}
    if name not in makers:
        raise ParamError("backend", f"unknown {{}} {name!r}: use one of {', '.join(BACKENDS)}")
    return makers[name](tuple(devices))
