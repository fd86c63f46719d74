"""Where a training step's time goes: each op inside the compiled step (XLA:CPU's profiler
events), and each of its convolutions timed alone."""

from __future__ import annotations

import collections
import glob
import re
import tempfile
import time
from typing import Any, Callable

import jax
import numpy as np
from jax import lax

from experiments.measure import timing
from jax_dp.models.model import Model

# Kinds of work, in the order tables list them; "rest" is the step less its convolutions.
KINDS = ("conv forward", "conv dX", "conv dW", "rest")
_DEF = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = f32\[([\d,]*)\]")
_NAME = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ", re.M)
_CONV = re.compile(r"convolution\(%?([\w.\-]+), %?([\w.\-]+)\), window=\{([^}]*)\}, "
                   r"dim_labels=b01f_01io->b01f")


def _pairs(text: str, key: str, default) -> tuple:
    """'size=3x3 pad=1_1x0_1' with key 'pad' -> ((1, 1), (0, 1)); key 'size' -> (3, 3)."""
    found = re.search(rf"\b{key}=(\S+)", text)
    if not found:
        return (default, default)
    return tuple(tuple(int(v) for v in part.split("_")) if "_" in part else int(part)
                 for part in found[1].split("x"))


def convolutions(hlo_text: str) -> list[dict]:
    """Every canonical convolution of an optimized HLO module: its name, kind (forward, or
    jax_dp.xla_cpu.conv's conv_dx / conv_dw scopes), operand and output shapes, window."""
    shapes = {m[1]: tuple(int(d) for d in m[2].split(",") if d)
              for m in map(_DEF.match, hlo_text.splitlines()) if m}
    convs = []
    for line in hlo_text.splitlines():
        conv = _CONV.search(line)
        if not conv:
            continue
        name = _DEF.match(line)[1]
        window = conv[3]
        convs.append({
            "op": name, "kind": "conv dX" if "conv_dx" in line else
            "conv dW" if "conv_dw" in line else "conv forward",
            "lhs": shapes[conv[1]], "rhs": shapes[conv[2]], "out": shapes[name],
            "strides": _pairs(window, "stride", 1), "padding": _pairs(window, "pad", (0, 0)),
            "lhs_dilation": _pairs(window, "lhs_dilate", 1),
            "rhs_dilation": _pairs(window, "rhs_dilate", 1)})
    return convs


def _median_ms(fn: Callable, *args, repeats: int) -> float:
    """Median milliseconds of fn(*args) after one untimed call."""
    run = lambda: jax.block_until_ready(fn(*args))
    run()
    return 1e3 * timing.median_s(run, repeats)


def alternate(first: Callable[[], Any], second: Callable[[], Any],
              pairs: int) -> tuple[list[float], list[float]]:
    """Seconds of pairs runs each of first and second, taken in turns after a warm-up of
    each, so the slow spells of a shared host fall on both alike; each must block until done."""
    first(), second()
    times = ([], [])
    for _ in range(pairs):
        for fn, record in zip((first, second), times):
            start = time.perf_counter()
            fn()
            record.append(time.perf_counter() - start)
    return times


def time_convolution(conv: dict, repeats: int = 5) -> float:
    """Milliseconds (median of repeats) of one convolution alone, as XLA compiles it alone."""
    rng = np.random.default_rng(0)
    lhs, rhs = (rng.random(conv[s], np.float32) for s in ("lhs", "rhs"))
    fn = jax.jit(lambda a, b: lax.conv_general_dilated(
        a, b, conv["strides"], conv["padding"], conv["lhs_dilation"], conv["rhs_dilation"],
        dimension_numbers=("NHWC", "HWIO", "NHWC")))
    if fn(lhs, rhs).shape != conv["out"]:
        raise RuntimeError(f"{conv['op']} rebuilt with the wrong output shape")
    return _median_ms(fn, lhs, rhs, repeats=repeats)


def step_profile(model: Model, batch_size: int, repeats: int = 5) -> dict:
    """A single-device SGD step on batch_size images, and each of its convolutions, timed
    alone: {"step_ms", "convs": [{..., "ms", "gflops"}, ...], "by_kind": {KINDS: ms},
    "traced_ms" (the step under the profiler), "in_step": {kind of op: ms}}."""
    compiled, *arguments = timing.single_step(model, batch_size)
    step_ms = _median_ms(compiled, *arguments, repeats=repeats)
    convs = convolutions(compiled.as_text())
    for conv in convs:
        conv["ms"] = time_convolution(conv, repeats)
        macs = np.prod(conv["out"]) * np.prod(conv["rhs"][:3])  # Per output: kh kw C_in.
        conv["gflops"] = 2 * macs / conv["ms"] / 1e6
    sums = {kind: sum(c["ms"] for c in convs if c["kind"] == kind) for kind in KINDS[:-1]}
    # XLA:CPU runs convolutions asynchronously on Eigen's pool: their events cover only their
    # launch, so inside the step they are what the other ops' events leave uncovered.
    conv_ops = {c["op"] for c in convs}
    all_ops, traced_ms = in_step(compiled, arguments, repeats)
    ops = {op: ms for op, ms in all_ops.items() if op not in conv_ops}
    inside = collections.Counter()
    for op, ms in ops.items():
        inside[group(op)] += ms
    by_op_kind = {**dict(inside.most_common()), "convolutions and gaps": traced_ms - sum(ops.values())}
    return {"step_ms": step_ms, "convs": sorted(convs, key=lambda c: -c["ms"]),
            "by_kind": {**sums, "rest": step_ms - sum(sums.values())},
            "traced_ms": traced_ms, "in_step": by_op_kind}


def _covered_ns(intervals: list[tuple[int, int]]) -> int:
    """Nanoseconds covered by the union of [start, end) intervals."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def in_step(compiled, arguments: tuple, repeats: int = 3) -> tuple[dict[str, float], float]:
    """Milliseconds per step each op of a compiled step runs inside it: the wall time its
    events on XLA:CPU's threads cover (one op's parallel pieces counted once), by HLO name;
    and the wall time of those traced steps, per step."""
    names = set(_NAME.findall(compiled.as_text()))
    jax.block_until_ready(compiled(*arguments))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            start = time.perf_counter()
            for _ in range(repeats):
                jax.block_until_ready(compiled(*arguments))
            step_ms = (time.perf_counter() - start) / repeats * 1e3
        (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    return op_ms(data.planes, names, repeats), step_ms


def op_ms(planes, names: set[str], steps: int) -> dict[str, float]:
    """Milliseconds per step that each op of names covers with its events on a profile's planes
    and lines (threads) over steps traced steps, its parallel pieces counted once."""
    intervals = collections.defaultdict(list)
    for plane in planes:
        for line in plane.lines:
            for event in line.events:
                if event.name in names:
                    intervals[event.name].append((event.start_ns,
                                                  event.start_ns + event.duration_ns))
    return {name: _covered_ns(iv) / steps / 1e6 for name, iv in intervals.items()}


def group(op: str) -> str:
    """An op's kind of work: its HLO name without the number (transpose_copy_fusion.3)."""
    return re.sub(r"\.\d+$", "", op)
