"""When does data parallelism pay? A step's cost as compute + all-reduce + fixed cost (α-β model)."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from jax_dp.allreduce import bytes_sent
from jax_dp.errors import ParamError

# psum is modelled as a ring: what NCCL and gloo run for large messages.
SCHEMES = ("psum", "ring", "star")


class Link(NamedTuple):
    """A transport: alpha seconds of latency per message, beta seconds per byte."""
    alpha: float
    beta: float


def fit_link(n_bytes: Sequence[float], seconds: Sequence[float]) -> Link:
    """Least-squares t = alpha + beta * n over measured (message bytes, seconds) pairs."""
    n, t = np.asarray(n_bytes, float), np.asarray(seconds, float)
    if len(n) < 2 or len(set(n)) < 2:
        raise ParamError("n_bytes", "{} needs at least two different message sizes to fit")
    (alpha, beta), *_ = np.linalg.lstsq(np.stack([np.ones_like(n), n], 1), t, rcond=None)
    return Link(float(alpha), float(beta))


def busiest_link(scheme: str, n_bytes: int, k: int) -> tuple[int, int]:
    """(messages, bytes) that pass the busiest device's link one after another when n_bytes of
    float32 gradients are all-reduced over k devices by scheme.

    ring: 2(k-1) rounds, each sending a chunk while receiving one (full duplex);
    star: device 0 receives k-1 gradients, then sends k-1 sums: twice what it sends.
    """
    if scheme not in SCHEMES:
        raise ParamError("scheme", f"unknown {{}} {scheme!r}: use one of {', '.join(SCHEMES)}")
    if k == 1:
        return 0, 0
    floats = -(-n_bytes // 4)
    if scheme == "star":
        return 2 * (k - 1), 2 * bytes_sent("star", floats, k)[0]
    return 2 * (k - 1), bytes_sent("ring", floats, k)[0]


def allreduce_s(link: Link, scheme: str, n_bytes: int, k: int) -> float:
    """Seconds to all-reduce n_bytes over k devices on link: alpha per message, beta per byte,
    on the busiest device's link (busiest_link)."""
    messages, sent = busiest_link(scheme, n_bytes, k)
    return messages * link.alpha + sent * link.beta


def step_s(compute_s: float, comm_s: float, fixed_s: float, overlap: bool = False,
           backward_share: float = 2 / 3) -> float:
    """A data-parallel step: compute, then the gradients' all-reduce, plus a fixed cost. With
    overlap (a model: buckets all-reduced as the backward pass makes them), communication
    hides behind the backward pass, backward_share of the compute."""
    if overlap:
        return compute_s + max(0.0, comm_s - backward_share * compute_s) + fixed_s
    return compute_s + comm_s + fixed_s
