"""The program: a model's steps on a backend's devices, placed, compiled and run.

The run loop and every measuring tool reach compiled steps only through a Program, so each
times, inspects and compares the step that training runs.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
from jax import lax

from jax_dp import dispatch
from jax_dp.backends import Backend
from jax_dp.step import Steps, TrainState, zero_metrics


class Program:
    """steps (pure, per shard) wrapped for backend: state placed on its devices, each kind of
    step compiled once per shape of its data, and run; a training step donates the state it
    is given unless donate is False (to call it again on the same state).

    A step called before it is compiled ahead (`compile`) runs through the backend's own
    wrapper (jax.pmap, jax.jit), which compiles it on first use. Its kinds: "train" (one step
    on a placed batch), "calls" (several under lax.scan, `scanned`) and "evaluate"; each
    takes (state, metrics, ..., its data last).
    """

    def __init__(self, backend: Backend, steps: Steps, donate: bool = True):
        self.backend = backend
        self.steps = steps
        self.pad_to = steps.pad_to or len(backend.devices)  # Rows a global batch is padded to.
        wrap, donated = self.backend.wrap, (0,) if donate else ()
        # A donated state's buffers become the step's outputs: the state passed in is gone.
        self.wrapped = {"train": wrap(steps.train_step, donate_argnums=donated),
                        "calls": wrap(scanned(steps.train_step), donate_argnums=donated)}
        if steps.eval_step is not None:
            self.wrapped["evaluate"] = wrap(steps.eval_step)
        self.compiled: dict[tuple, Callable] = {}  # (kind, data's shapes) -> compiled step.

    def place(self, state: TrainState) -> tuple[TrainState, dict]:
        """A host state, and zero metrics, on the devices: one copy on each."""
        return self.backend.replicate(state), self.zero_metrics()

    def zero_metrics(self) -> dict:
        """Zero metrics, placed."""
        return self.backend.replicate(zero_metrics())

    def shard(self, batch: Any) -> Any:
        """A host global batch (or call) split over the devices."""
        return self.backend.shard(batch)

    def lower(self, kind: str, *args) -> Any:
        """The kind of step lowered for args (placed values, or jax.ShapeDtypeStructs): its
        HLO and XLA's cost analysis."""
        return self.wrapped[kind].lower(*args)

    def compile(self, kind: str, *args) -> Callable:
        """The kind of step compiled ahead for args like these (placed), kept for every later
        call on data of their shape; memory_analysis() and as_text() where the backend allows."""
        compiled = self.backend.compile(self.wrapped[kind], *args)
        self.compiled[(kind, _shapes(args[-1]))] = compiled
        return compiled

    def __call__(self, kind: str, *args):
        """The kind of step on args: compiled ahead where it was for their shape."""
        return self.compiled.get((kind, _shapes(args[-1])), self.wrapped[kind])(*args)

    def train(self, state: TrainState, metrics: dict, batch: Any) -> tuple[TrainState, dict]:
        """One training step on a placed global batch."""
        return self("train", state, metrics, batch)

    def evaluate(self, state: TrainState, metrics: dict, batch: Any) -> dict:
        """metrics plus a placed batch's sums (loss, correct, count)."""
        return self("evaluate", state, metrics, batch)

    def train_batches(self, state: TrainState, metrics: dict, batches: Iterable,
                      in_flight: dispatch.InFlight | None = None) -> tuple[TrainState, dict]:
        """state and metrics after a training step on each placed batch, at most
        dispatch.MAX_IN_FLIGHT steps ahead of the host; the last ones are waited for unless
        in_flight is given."""
        waiting = in_flight or dispatch.InFlight()
        for batch in batches:
            state, metrics = self.train(state, metrics, batch)
            waiting.add(metrics)
        if in_flight is None:
            waiting.drain()
        return state, metrics


def scanned(step: Callable) -> Callable:
    """step(state, metrics, batch) as scanned_call(state, metrics, examples, call): call's
    steps, in order, under one lax.scan, each batch gathered from examples (feeds.on_device's)
    by index."""
    def scanned_call(state, metrics, examples, call):
        def body(carry, xs):
            index, mask = xs
            batch = {"image": jnp.take(examples["image"], index, axis=0),
                     "label": jnp.take(examples["label"], index, axis=0), "mask": mask}
            return step(*carry, batch), None

        (state, metrics), _ = lax.scan(body, (state, metrics), (call["index"].T, call["mask"].T))
        return state, metrics
    return scanned_call


def _shapes(data: Any) -> tuple:
    """What a compiled step is kept by: its data's tree of shapes and dtypes."""
    leaves, tree = jax.tree.flatten(data)
    return tree, tuple((x.shape, x.dtype) for x in leaves)
