"""Ways to run a per-shard step over devices; each backend lives in its own file."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax


class Backend(NamedTuple):
    """How state and batches are placed on devices, and how a per-shard step is compiled.

    compile(fn, donate_argnums) takes fn(state, metrics, batch) written for one shard
    (collectives over `axis_name`) and returns the step to call on placed values.
    """
    name: str
    devices: tuple[jax.Device, ...]
    axis_name: str | None
    replicate: Callable[[Any], Any]
    shard: Callable[[Any], Any]
    unreplicate: Callable[[Any], Any]
    compile: Callable[..., Callable]


def make_backend(name: str, devices: Sequence[jax.Device]) -> Backend:
    """The backend called name ('single', 'pmap') over devices."""
    from jax_dp.backends import pmap, single

    makers = {"single": single.make, "pmap": pmap.make}
    if name not in makers:
        raise ValueError(f"unknown backend {name!r}: use one of {', '.join(makers)}")
    return makers[name](tuple(devices))
