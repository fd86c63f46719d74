"""Timing training steps: throughput, compile time, model FLOPs and the machine's matmul ceiling."""

from __future__ import annotations

import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_dp import dispatch, train
from jax_dp.backends import make_backend
from jax_dp.models import Model


def matmul_ceiling(n: int = 2048, repeats: int = 7) -> float:
    """The machine's float32 matrix-product rate in GFLOP/s (numpy, median of repeats)."""
    rng = np.random.default_rng(0)
    a, b = rng.random((n, n), np.float32), rng.random((n, n), np.float32)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n**3 / float(np.median(times)) / 1e9


def single_step(model: Model, batch_size: int, image_shape=(28, 28, 1)) -> tuple:
    """One single-device SGD step compiled for batch_size zero images, and its arguments:
    (compiled step, state, metrics, batch)."""
    tx = optax.sgd(0.1)
    state = train.init_state(model, tx, jax.random.key(0))
    batch = {"image": jnp.zeros((batch_size, *image_shape)), "label": jnp.zeros(batch_size, jnp.int32),
             "mask": jnp.ones(batch_size)}
    step = jax.jit(functools.partial(train.train_step, model=model, tx=tx, axis_name=None))
    return step.lower(state, train.zero_metrics(), batch).compile(), state, train.zero_metrics(), batch


def step_flops(model: Model, batch_size: int, image_shape=(28, 28, 1)) -> float:
    """FLOPs of one single-device training step on batch_size images, as XLA counts them."""
    cost = single_step(model, batch_size, image_shape)[0].cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def time_steps(model: Model, backend: str, devices: Sequence[jax.Device], batches: list[dict],
               repeats: int = 3, lr: float = 0.1) -> dict:
    """Compile once, then run all batches `repeats` times; seconds per step of each repeat.

    Steps are dispatched as in training (at most dispatch.MAX_IN_FLIGHT ahead) and each
    repeat ends when its last step has finished.
    """
    tx = optax.sgd(lr)
    steps = train.make_steps(model, tx, make_backend(backend, devices))
    b = steps.backend
    state = b.replicate(train.init_state(model, tx, jax.random.key(0)))
    placed = [b.shard(batch) for batch in batches]
    metrics = b.replicate(train.zero_metrics())
    start = time.perf_counter()
    step = steps.train_batch.lower(state, metrics, placed[0]).compile()
    compile_s = time.perf_counter() - start
    per_step = []
    for _ in range(repeats):
        in_flight = dispatch.InFlight()
        start = time.perf_counter()
        for batch in placed:
            state, metrics = step(state, metrics, batch)
            in_flight.add(metrics)
        in_flight.drain()
        per_step.append((time.perf_counter() - start) / len(placed))
    return {"compile_s": compile_s, "step_s": per_step}
