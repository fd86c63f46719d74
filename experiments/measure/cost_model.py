"""When does data parallelism pay? A step's cost as compute + all-reduce + fixed cost (α-β
model): fitted to measured parts, checked against measured steps, drawn for hardware profiles."""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import numpy as np

from jax_dp.schemes import bytes_sent
from jax_dp.backends import ALLREDUCES
from jax_dp.config import SIZES
from jax_dp.devices import check_count
from jax_dp.errors import ParamError, check_choice

# The book's runs (batch, lr, weak or strong scaling, seconds per epoch on 1 and 2 GPUs).
BOOK = {"lenet": {"batch_size": 256, "lr": 0.2, "weak": False, "seconds": {1: 1.6, 2: 2.4}},
        "resnet18": {"batch_size": 256, "lr": 0.1, "weak": True, "seconds": {1: 13.6, 2: 7.0}}}
CURVE_DEVICES = (1, 2, 4, 8, 16, 32, 64)

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


def analyse(model: str, batch: int, grad: int, measured: dict, cores: int, profiles: dict,
            shapes: dict) -> dict:
    """Fit lines and links to measured, predict every measured config, and draw every profile's
    curves for the models' shapes (flops_per_image, grad_bytes by name)."""
    lines = {int(c): fit_line([int(b) for b in t], list(t.values()))
             for c, t in measured["compute"].items()}
    links = fit_links(measured["configs"])
    checks = [predict(name, m, batch, grad, lines, links, cores)
              for name, m in measured["configs"].items()]
    return {"model": model, "batch_size": batch, "grad_bytes": grad, "measured": measured,
            "lines": {str(c): line._asdict() for c, line in lines.items()},
            "links": {t: {s: link._asdict() for s, link in by.items()} for t, by in links.items()},
            "checks": checks, "shapes": shapes, "profiles": curves(profiles, shapes),
            "book": book(profiles["v100-pcie"], shapes) if "v100-pcie" in profiles else None}


def fit_links(configs: dict) -> dict[str, dict[str, Link]]:
    """A link per transport and scheme, fitted to the all-reduces measured in configs."""
    samples = {}  # transport -> scheme -> [(messages, bytes, seconds)]
    for name, m in configs.items():
        transport, _, k = layout(name)
        for a in m["allreduce"]:
            messages, sent = busiest_link(a["scheme"], a["bytes"], k)
            samples.setdefault(transport, {}).setdefault(a["scheme"], []).append(
                (messages, sent, a["seconds"]))
    return {t: {s: fit_link(*zip(*points)) for s, points in by.items()}
            for t, by in samples.items()}


def predict(name: str, m: dict, batch: int, grad: int, lines: dict[int, Line],
            links: dict[str, dict[str, Link]], cores: int) -> dict:
    """Config name's step predicted from the lines (by cores), the psum links and its own fixed
    cost and arrays, beside the step measured (m)."""
    transport, processes, k = layout(name)
    # One device alone uses every core of its process (XLA:CPU's intra-op threads). Several
    # run side by side, a core each, taking turns where there are more devices than cores;
    # each process of several has one core of its own. gloo runs between processes.
    local, own_cores = k // processes, cores if processes == 1 else 1
    compute = lines[cores](batch) if k == 1 else \
        math.ceil(local / own_cores) * lines[1](batch / k)
    link = links.get(transport, {}).get("psum")
    comm = allreduce_s(link, "psum", grad, processes if processes > 1 else k,
                       m["arrays"]) if link else 0.0
    predicted = {o: step_s(compute, comm, m["fixed_s"], overlap=o) for o in (False, True)}
    return {"config": name, "devices": k, "processes": processes, "compute_s": compute,
            "arrays": m["arrays"], "allreduce_s": comm, "fixed_s": m["fixed_s"],
            "measured_s": m["step_s"], "predicted_s": predicted[False],
            "predicted_overlap_s": predicted[True], "error": predicted[False] / m["step_s"] - 1}


def curves(profiles: dict, shapes: dict) -> dict:
    """Each profile's predicted speedups up to 64 devices (each model at the book's batch of
    256, weak and strong scaling, with and without overlap) and its crossover batches."""
    out = {}
    for key, hw in profiles.items():
        out[key] = {"name": hw.name}
        for name, s in shapes.items():
            step = {o: hw.step(s["flops_per_image"], s["grad_bytes"], overlap=o)
                    for o in (False, True)}
            out[key][name] = {
                f"{'weak' if weak else 'strong'}{'_overlap' if o else ''}":
                    [speedup(step[o], BOOK[name]["batch_size"], k, weak) for k in CURVE_DEVICES]
                for weak in (True, False) for o in (False, True)}
            out[key][name]["min_batch"] = {
                k: min_batch(s["flops_per_image"] / hw.flops,
                             allreduce_s(hw.link(k), "ring", s["grad_bytes"], k), hw.fixed_s)
                for k in (2, 8, 64)}
    return out


def book(hw, shapes: dict) -> dict:
    """The book's epoch times (1 and 2 GPUs) against the model on a V100-over-PCIe profile: as
    the profile stands, and with a per-step offset that makes its 1-GPU time the book's."""
    out = {}
    for name, b in BOOK.items():
        s = shapes[name]
        step = hw.step(s["flops_per_image"], s["grad_bytes"])
        steps_per_epoch = math.ceil(SIZES["train"] / b["batch_size"])

        def epoch(k, fixed=0.0):
            per_device, global_batch = (b["batch_size"], b["batch_size"] * k) if b["weak"] else \
                (b["batch_size"] / k, b["batch_size"])
            return math.ceil(SIZES["train"] / global_batch) * (step(per_device, k) + fixed)
        extra = b["seconds"][1] / steps_per_epoch - step(b["batch_size"], 1)
        out[name] = {"book_s": b["seconds"], "profile_s": {k: epoch(k) for k in (1, 2)},
                     "offset_s": extra,
                     "calibrated_s": {k: epoch(k, extra) for k in (1, 2)}}
    return out
