"""When does data parallelism pay? A step's cost as compute + all-reduce + fixed cost (α-β model)."""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np

from jax_dp.allreduce import bytes_sent
from jax_dp.devices import check_count
from jax_dp.backends import ALLREDUCES
from jax_dp.errors import ParamError, check_choice

# psum is modelled as a ring: what NCCL and gloo run for large messages.


class Link(NamedTuple):
    """A transport: alpha seconds of latency per message, beta seconds per byte."""
    alpha: float
    beta: float


class Line(NamedTuple):
    """Compute time against the per-device batch b: intercept + slope * b seconds."""
    intercept: float
    slope: float

    def __call__(self, b: float) -> float:
        return self.intercept + self.slope * b


def _lstsq(columns: list[np.ndarray], t: np.ndarray) -> list[float]:
    coefficients, *_ = np.linalg.lstsq(np.stack(columns, 1), t, rcond=None)
    return [float(c) for c in coefficients]


def fit_line(batches: Sequence[float], seconds: Sequence[float]) -> Line:
    """Least-squares compute line over measured (per-device batch, seconds) pairs."""
    b, t = np.asarray(batches, float), np.asarray(seconds, float)
    if len(set(b)) < 2:
        raise ParamError("batches", "{} needs at least two different batch sizes to fit")
    return Line(*_lstsq([np.ones_like(b), b], t))


def fit_link(messages: Sequence[float], n_bytes: Sequence[float], seconds: Sequence[float]) -> Link:
    """Least-squares t = alpha * messages + beta * bytes over measured all-reduces, each given
    by the messages and bytes on its busiest link (busiest_link)."""
    m, n, t = (np.asarray(v, float) for v in (messages, n_bytes, seconds))
    if len(set(n / m)) < 2:
        raise ParamError("n_bytes", "{} needs at least two different message sizes to fit")
    return Link(*_lstsq([m, n], t))


def layout(config: str) -> tuple[str, int, int]:
    """A config 'PxL' (P processes of L devices each) as (transport, processes, devices): gloo
    between processes, else one process's own all-reduce."""
    processes, local = map(int, config.split("x"))
    return ("gloo" if processes > 1 else "in-process"), processes, processes * local


def busiest_link(scheme: str, n_bytes: int, k: int) -> tuple[int, int]:
    """(messages, bytes) that pass the busiest device's link one after another when n_bytes of
    float32 gradients are all-reduced over k devices by scheme.

    ring: 2(k-1) rounds, each sending a chunk while receiving one (full duplex);
    star: device 0 receives k-1 gradients, then sends k-1 sums: twice what it sends.
    """
    check_choice("scheme", scheme, ALLREDUCES)
    if k == 1:
        return 0, 0
    floats = -(-n_bytes // 4)
    if scheme == "star":
        return 2 * (k - 1), 2 * bytes_sent("star", floats, k)[0]
    return 2 * (k - 1), bytes_sent("ring", floats, k)[0]


def allreduce_s(link: Link, scheme: str, n_bytes: int, k: int, arrays: int = 1) -> float:
    """Seconds to all-reduce n_bytes over k devices on link, held in `arrays` arrays that are
    summed one after another: alpha per message of each, beta per byte, on the busiest
    device's link (busiest_link)."""
    messages, sent = busiest_link(scheme, n_bytes, k)
    return arrays * messages * link.alpha + sent * link.beta


def step_s(compute_s: float, comm_s: float, fixed_s: float, overlap: bool = False,
           backward_share: float = 2 / 3) -> float:
    """A data-parallel step: compute, then the gradients' all-reduce, plus a fixed cost. With
    overlap (a model: buckets all-reduced as the backward pass makes them), communication
    hides behind the backward pass, backward_share of the compute."""
    if overlap:
        return compute_s + max(0.0, comm_s - backward_share * compute_s) + fixed_s
    return compute_s + comm_s + fixed_s


def speedup(step: Callable[[float, int], float], batch: int, k: int, weak: bool) -> float:
    """Images per second on k devices over one device's, for step(per-device batch, k) in
    seconds: weak scaling keeps batch per device (global batch x k), strong splits it k ways."""
    check_count(k)
    per_device = batch if weak else batch / k
    return (k * per_device / step(per_device, k)) / (batch / step(batch, 1))


def min_batch(slope: float, comm_s: float, flat_s: float, efficiency: float = 0.5) -> float:
    """The smallest per-device batch b at which k devices run at `efficiency` of k times one
    device's throughput (weak scaling, no overlap): a step of slope*b + flat_s seconds on one
    device (flat_s: what does not grow with the batch), plus comm_s on k, solved for b."""
    return max(0.0, (efficiency * comm_s / (1 - efficiency) - flat_s) / slope)
