"""Timing training steps: throughput, compile time, model FLOPs and the machine's matmul ceiling."""

from __future__ import annotations

import re
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
import optax

from jax_dp import assembly, data, feeds, program as program_lib, step as step_lib
from jax_dp.schemes import get_allreduce
from jax_dp.backends import make_backend
from jax_dp.models.model import Model


def median_s(run: Callable[[], Any], repeats: int, per: int = 1) -> float:
    """Median seconds of run() (which blocks until done) over repeats, divided by per."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) / per


def sgd_state(model: Model, lr: float = 0.1, shapes: bool = False) -> tuple:
    """SGD at lr, and the state it steps from (seed 0): only its shapes when shapes."""
    tx = optax.sgd(lr)
    init = lambda: step_lib.init_state(model, tx, jax.random.key(0))
    return tx, (jax.eval_shape(init) if shapes else init())


def matmul_ceiling(n: int = 2048, repeats: int = 7) -> float:
    """The machine's float32 matrix-product rate in GFLOP/s (numpy, median of repeats)."""
    rng = np.random.default_rng(0)
    a, b = rng.random((n, n), np.float32), rng.random((n, n), np.float32)
    a @ b
    return 2 * n**3 / median_s(lambda: a @ b, repeats) / 1e9


def single(model: Model, lr: float = 0.1, donate: bool = True) -> tuple[program_lib.Program,
                                                                      optax.GradientTransformation]:
    """The single-device program of model's SGD steps at lr (no collectives), and its SGD."""
    tx = optax.sgd(lr)
    return assembly.build(model, tx, "single", jax.devices()[:1], donate=donate), tx


def single_step(model: Model, batch_size: int, image_shape=(28, 28, 1)) -> tuple:
    """One single-device SGD step compiled for batch_size zero images, and its arguments:
    (compiled step, state, metrics, batch), to call as often as wanted (nothing donated)."""
    program, tx = single(model, donate=False)
    state, metrics = program.place(sgd_state(model)[1])
    batch = program.shard(data.zero_batch(batch_size, image_shape))
    return program.compile("train", state, metrics, batch), state, metrics, batch


def step_flops(model: Model, batch_size: int, image_shape=(28, 28, 1)) -> float:
    """FLOPs of one single-device training step on batch_size images, as XLA counts them in the
    step JAX lowers (no compile: within 0.5% of the optimized step's count)."""
    program, _ = single(model)
    state = sgd_state(model, shapes=True)[1]
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                         data.zero_batch(batch_size, image_shape))
    cost = program.lower("train", state, jax.eval_shape(step_lib.zero_metrics),
                         batch).cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def time_steps(model: Model, backend: str, devices: Sequence[jax.Device], batches: list[dict],
               repeats: int = 3, lr: float = 0.1, exact: bool = False) -> dict:
    """Compile once, then run all batches `repeats` times; seconds per step of each repeat.

    Steps are dispatched as in training (at most dispatch.MAX_IN_FLIGHT ahead) and each
    repeat ends when its last step has finished; one untimed step first warms up.
    exact: the exact mode's step (jax_dp.exact; batches padded to its micro-batches).
    """
    tx, state = sgd_state(model, lr)
    program = assembly.build(model, tx, backend, devices, exact=exact)
    state, metrics = program.place(state)
    placed = [program.shard(batch) for batch in batches]
    start = time.perf_counter()
    program.compile("train", state, metrics, placed[0])
    compile_s = time.perf_counter() - start
    state, metrics = jax.block_until_ready(program.train(state, metrics, placed[0]))
    per_step = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, metrics = program.train_batches(state, metrics, placed)
        per_step.append((time.perf_counter() - start) / len(placed))
    return {"compile_s": compile_s, "step_s": per_step}


def time_exact(model: Model, devices: Sequence[jax.Device], batches: list[dict],
               rounds: int) -> tuple[list[float], list[float]]:
    """The normal and the exact mode's mean seconds per step (pmap over devices, batches padded
    to the exact mode's micro-batches), timed in turn, rounds times each."""
    def timed(exact):
        return time_steps(model, "pmap", devices, batches, repeats=1, exact=exact)["step_s"][0]
    normal, exact = zip(*[(timed(False), timed(True)) for _ in range(rounds)])
    return list(normal), list(exact)


def time_compute(model: Model, batch_size: int, steps: int = 4, repeats: int = 3) -> float:
    """Seconds per training step on one device with no collective and no dispatch between
    steps (steps of them per compiled call, under lax.scan): the step's compute alone."""
    program, _ = single(model)
    state, metrics = program.place(sgd_state(model)[1])
    n = batch_size * steps
    split = program.shard(feeds.on_device(data.Split(np.zeros((n, 28, 28, 1), np.float32),
                                                     np.zeros(n, np.int32))))
    call = program.shard(next(feeds.calls(n, batch_size, steps, order=np.arange(n))))
    compiled = program.compile("calls", state, metrics, split, call)

    def calls():
        nonlocal state
        state, metrics = compiled(state, program.zero_metrics(), split, call)
        jax.block_until_ready(metrics)
    calls()
    return median_s(calls, repeats, steps)


def time_allreduce(scheme: str, floats: int, devices: Sequence[jax.Device], repeats: int = 5,
                   calls: int = 5) -> float:
    """Seconds per all-reduce (schemes.BY_NAME[scheme]) of floats float32 numbers held by
    every one of devices (several processes' included), each call waited for."""
    backend = make_backend("pmap", devices)
    reduce = backend.wrap(get_allreduce(scheme, "pmap"))
    x = backend.shard(np.ones((len(devices), floats), np.float32))

    def run():
        for _ in range(calls):
            jax.block_until_ready(reduce(x))
    run()
    return median_s(run, repeats, calls)


def time_fixed(model: Model, devices: Sequence[jax.Device], batch_size: int, repeats: int = 5,
               calls: int = 20) -> float:
    """Seconds per call of a step that does no work on training's arguments (the model's state,
    metrics, a placed batch), dispatched as time_steps does: the per-step fixed cost."""
    def idle(state, metrics, batch):
        return state, {**metrics, "count": metrics["count"] + batch["mask"].sum()}

    program = program_lib.Program(make_backend("pmap", devices), step_lib.Steps(idle))
    state, metrics = program.place(sgd_state(model)[1])
    batch = program.shard(data.zero_batch(batch_size))

    def run():
        nonlocal state, metrics
        state, metrics = program.train_batches(state, metrics, [batch] * calls)
    run()
    return median_s(run, repeats, calls)


def allreduced_arrays(model: Model, devices: Sequence[jax.Device], batch_size: int) -> int:
    """Arrays the pmapped training step all-reduces: the operands of every all-reduce in its
    compiled HLO (XLA combines the gradients into one tuple all-reduce; gloo sums each array
    as a collective of its own)."""
    tx, state = sgd_state(model)
    program = assembly.build(model, tx, "pmap", devices)
    batch = program.shard(data.zero_batch(batch_size))
    # Lowered and compiled here: a multi-process pmap program keeps its wrapper, not the executable.
    text = program.lower("train", *program.place(state), batch).compile().as_text()
    results = [m.group(1) for m in re.finditer(r"= (.*?) all-reduce(?:-start)?\(", text)]
    return sum(len(re.findall(r"\b[a-z]+\d*\[", r)) for r in results)
