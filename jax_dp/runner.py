"""Steps made ready to run: built for a backend's devices, state placed, compiled ahead, stepped.

The run loop and every measuring tool go through these four, so each times and compares the
step that training runs.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import jax
import optax

from jax_dp import allreduce, dispatch
from jax_dp.backends import make_backend
from jax_dp.exact import steps as exact_steps
from jax_dp.models.model import Model
from jax_dp.step import Steps, TrainState, make_steps, zero_metrics


def build_steps(model: Model, tx: optax.GradientTransformation, backend: str,
                devices: Sequence[jax.Device], *, exact: bool = False, scheme: str = "psum",
                compute_dtype: str = "float32") -> Steps:
    """The book's steps on backend over devices, gradients summed by scheme (allreduce.py);
    or, with exact, the exact mode's (jax_dp.exact)."""
    placed = make_backend(backend, devices)
    if exact:
        return exact_steps.make_steps(model, tx, placed, compute_dtype)
    return make_steps(model, tx, placed, allreduce.for_step(scheme), compute_dtype)


def place(steps: Steps, state: TrainState) -> tuple[TrainState, dict]:
    """A host state, and zero metrics, on steps' devices: one copy on each."""
    return steps.backend.replicate(state), steps.backend.replicate(zero_metrics())


def compile_train(steps: Steps, state: TrainState, metrics: dict, batch: dict) -> Callable:
    """steps.train_batch compiled ahead of time for placed state and metrics and a host batch
    of this shape."""
    return steps.backend.precompile(steps.train_batch, state, metrics, steps.backend.shard(batch))


def run(step: Callable, state: Any, metrics: dict, calls: Iterable,
        in_flight: dispatch.InFlight | None = None) -> tuple[Any, dict]:
    """state and metrics after step over each placed call, at most dispatch.MAX_IN_FLIGHT
    steps ahead of the host; the last ones are waited for unless in_flight is given."""
    waiting = in_flight or dispatch.InFlight()
    for call in calls:
        state, metrics = step(state, metrics, call)
        waiting.add(metrics)
    if in_flight is None:
        waiting.drain()
    return state, metrics
