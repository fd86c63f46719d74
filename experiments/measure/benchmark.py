"""Timing training steps: throughput, compile time, model FLOPs and the machine's matmul ceiling."""

from __future__ import annotations

import functools
import re
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
import optax

from jax_dp import data, feeds, runner, step as step_lib
from jax_dp.allreduce import get_allreduce
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


def single_step(model: Model, batch_size: int, image_shape=(28, 28, 1)) -> tuple:
    """One single-device SGD step compiled for batch_size zero images, and its arguments:
    (compiled step, state, metrics, batch)."""
    tx, state = sgd_state(model)
    batch = jax.device_put(data.zero_batch(batch_size, image_shape))
    step = jax.jit(functools.partial(step_lib.train_step, model=model, tx=tx, axis_name=None))
    return step.lower(state, step_lib.zero_metrics(), batch).compile(), state, step_lib.zero_metrics(), batch


def step_flops(model: Model, batch_size: int, image_shape=(28, 28, 1)) -> float:
    """FLOPs of one single-device training step on batch_size images, as XLA counts them in the
    step JAX lowers (no compile: within 0.5% of the optimized step's count)."""
    tx, state = sgd_state(model, shapes=True)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                         data.zero_batch(batch_size, image_shape))
    step = jax.jit(functools.partial(step_lib.train_step, model=model, tx=tx, axis_name=None))
    cost = step.lower(state, jax.eval_shape(step_lib.zero_metrics), batch).cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def time_steps(model: Model, backend: str, devices: Sequence[jax.Device], batches: list[dict],
               repeats: int = 3, lr: float = 0.1, exact: bool = False) -> dict:
    """Compile once, then run all batches `repeats` times; seconds per step of each repeat.

    Steps are dispatched as in training (at most dispatch.MAX_IN_FLIGHT ahead) and each
    repeat ends when its last step has finished; one untimed step first warms up.
    exact: the exact mode's step (jax_dp.exact; batches padded to its micro-batches).
    """
    tx, state = sgd_state(model, lr)
    steps = runner.build_steps(model, tx, backend, devices, exact=exact)
    state, metrics = runner.place(steps, state)
    placed = [steps.backend.shard(batch) for batch in batches]
    start = time.perf_counter()
    step = runner.compile_train(steps, state, metrics, batches[0])
    compile_s = time.perf_counter() - start
    state, metrics = jax.block_until_ready(step(state, metrics, placed[0]))
    per_step = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, metrics = runner.run(step, state, metrics, placed)
        per_step.append((time.perf_counter() - start) / len(placed))
    return {"compile_s": compile_s, "step_s": per_step}


def time_compute(model: Model, batch_size: int, steps: int = 4, repeats: int = 3) -> float:
    """Seconds per training step on one device with no collective and no dispatch between
    steps (steps of them per compiled call, under lax.scan): the step's compute alone."""
    tx, state = sgd_state(model)
    built = runner.build_steps(model, tx, "single", jax.devices()[:1])
    run = built.backend.compile(feeds.scanned(built.train_step), donate_argnums=(0,))
    n = batch_size * steps
    split = jax.device_put(feeds.on_device(data.Split(np.zeros((n, 28, 28, 1), np.float32),
                                                     np.zeros(n, np.int32))))
    call = jax.device_put(next(feeds.calls(n, batch_size, steps, order=np.arange(n))))
    compiled = run.lower(state, step_lib.zero_metrics(), split, call).compile()

    def calls():
        nonlocal state
        state, metrics = compiled(state, step_lib.zero_metrics(), split, call)
        jax.block_until_ready(metrics)
    calls()
    return median_s(calls, repeats, steps)


def time_allreduce(scheme: str, floats: int, devices: Sequence[jax.Device], repeats: int = 5,
                   calls: int = 5) -> float:
    """Seconds per all-reduce (allreduce.ALLREDUCES[scheme]) of floats float32 numbers held by
    every one of devices (several processes' included), each call waited for."""
    backend = make_backend("pmap", devices)
    reduce = backend.compile(get_allreduce(scheme, "pmap"))
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
    b = make_backend("pmap", devices)
    step = b.compile(lambda state, metrics, batch: (state, {
        **metrics, "count": metrics["count"] + batch["mask"].sum()}), donate_argnums=(0,))
    state = b.replicate(sgd_state(model)[1])
    metrics = b.replicate(step_lib.zero_metrics())
    batch = b.shard(data.zero_batch(batch_size))

    def run():
        nonlocal state, metrics
        state, metrics = runner.run(step, state, metrics, [batch] * calls)
    run()
    return median_s(run, repeats, calls)


def allreduced_arrays(model: Model, devices: Sequence[jax.Device], batch_size: int) -> int:
    """Arrays the pmapped training step all-reduces: the operands of every all-reduce in its
    compiled HLO (XLA combines the gradients into one tuple all-reduce; gloo sums each array
    as a collective of its own)."""
    tx, state = sgd_state(model)
    steps = runner.build_steps(model, tx, "pmap", devices)
    batch = steps.backend.shard(data.zero_batch(batch_size))
    text = steps.train_batch.lower(*runner.place(steps, state), batch).compile().as_text()
    results = [m.group(1) for m in re.finditer(r"= (.*?) all-reduce(?:-start)?\(", text)]
    return sum(len(re.findall(r"\b[a-z]+\d*\[", r)) for r in results)
