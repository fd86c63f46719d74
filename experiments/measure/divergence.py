"""How far two runs are apart: the measure every k-devices-vs-one comparison uses."""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_dp import assembly, step as step_lib
from jax_dp.devices import get_devices
from jax_dp.models.model import Model


def max_rel_diff(tree: Any, reference: Any) -> float:
    """max |tree - reference| / max |reference|, over all leaves at once (relative inf-norm)."""
    leaves, ref_leaves = jax.tree.leaves(tree), jax.tree.leaves(reference)
    if len(leaves) != len(ref_leaves):
        raise ValueError(f"trees differ in structure: {len(leaves)} vs {len(ref_leaves)} leaves")
    diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
               for a, b in zip(leaves, ref_leaves))
    scale = max(float(np.max(np.abs(np.asarray(b, np.float64)))) for b in ref_leaves)
    return diff / scale if scale else diff


def rel_l2_diff(tree: Any, reference: Any) -> float:
    """||tree - reference||_2 / ||reference||_2, over all leaves at once (relative 2-norm)."""
    pairs = [(np.asarray(a, np.float64), np.asarray(b, np.float64))
             for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(reference))]
    diff = sum(float(np.sum((a - b) ** 2)) for a, b in pairs)
    scale = sum(float(np.sum(b ** 2)) for _, b in pairs)
    return float(np.sqrt(diff / scale)) if scale else float(np.sqrt(diff))


def cast(tree: Any, dtype) -> Any:
    """Every floating-point leaf of tree as dtype (float64 needs jax.enable_x64)."""
    def to(leaf):
        leaf = jax.numpy.asarray(leaf)
        return leaf.astype(dtype) if jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating) else leaf
    return jax.tree.map(to, tree)


class Config(NamedTuple):
    """One way to run the step: a backend name over a number of devices."""
    backend: str
    devices: int


def compare(model: Model, batches: Sequence[dict], configs: Sequence[Config], *, lr: float,
            seed: int = 0, dtype=jnp.float32, exact: bool = False) -> dict:
    """Step every config in lockstep from the same params on the same global batches.

    The reference is the single-device jax.jit step. After each step every config's
    params (and model state, e.g. BatchNorm statistics) are compared with the
    reference's by max_rel_diff; each step is timed to completion, apart from compiling.
    With exact, every run (the reference too) takes the exact mode's step.
    """
    tx = optax.sgd(lr)
    # On the host, so each backend places (and may donate) its own copy.
    init = jax.device_get(cast(step_lib.init_state(model, tx, jax.random.key(seed)), dtype))
    runners = [_Runner(model, tx, c, init, batches[0], dtype, exact)
               for c in [Config("single", 1), *configs]]
    reference, others = runners[0], runners[1:]
    for batch in batches:
        for r in runners:
            r.step(cast(batch, dtype))
        for r in others:
            r.compare(reference)
    return {"reference": "single", "runs": [r.summary(len(batches[0]["label"])) for r in runners]}


class _Runner:
    """One config's state, compiled step, timings and divergence from the reference."""

    def __init__(self, model, tx, config, init, example_batch, dtype, exact):
        self.config = config
        self.program = assembly.build(model, tx, config.backend, get_devices(config.devices),
                                         exact=exact)
        self.state, metrics = self.program.place(init)
        start = time.perf_counter()
        self.program.compile("train", self.state, metrics,
                             self.program.shard(cast(example_batch, dtype)))
        self.compile_s = time.perf_counter() - start
        self.times, self.losses, self.diffs, self.l2_diffs = [], [], [], []

    def step(self, batch):
        program, backend = self.program, self.program.backend
        placed = program.shard(batch)
        start = time.perf_counter()
        self.state, metrics = program.train_batches(self.state, program.zero_metrics(), [placed])
        self.times.append(time.perf_counter() - start)  # run waited for the step.
        metrics = backend.unreplicate(metrics)
        self.losses.append(float(metrics["loss_sum"] / metrics["count"]))
        self.host = backend.unreplicate((self.state.params, self.state.model_state))

    def compare(self, reference):
        self.diffs.append(max_rel_diff(self.host, reference.host))
        self.l2_diffs.append(rel_l2_diff(self.host, reference.host))

    def summary(self, batch_size):
        step_s = float(np.median(self.times))
        run = {"backend": self.config.backend, "devices": self.config.devices,
               "compile_s": self.compile_s, "steps_per_s": 1 / step_s,
               "images_per_s": batch_size / step_s, "losses": self.losses}
        if self.diffs:
            run.update(max_rel_diff=self.diffs[-1], per_step_max_rel_diff=self.diffs,
                       rel_l2_diff=self.l2_diffs[-1], per_step_rel_l2_diff=self.l2_diffs)
        return run
