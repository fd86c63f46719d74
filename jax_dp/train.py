"""The pure train step, its evaluation twin, and the book's train() loop over any backend."""

from __future__ import annotations

import collections
import functools
import math
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

from jax_dp import data as data_lib
from jax_dp.backends import Backend, make_backend
from jax_dp.models import Model
from jax_dp.parallel import allreduce

# XLA:CPU can deadlock in a cross-device all-reduce when the host queues many pmapped
# steps without waiting, so the loops never let more than this many run ahead.
MAX_IN_FLIGHT = 2


class TrainState(NamedTuple):
    """Everything a step updates: params, model state (BatchNorm statistics), optimizer state."""
    params: Any
    model_state: Any
    opt_state: Any


def init_state(model: Model, tx: optax.GradientTransformation, key: jax.Array) -> TrainState:
    """Fresh params and model state from key, with the optimizer's initial state."""
    params, model_state = model.init(key)
    return TrainState(params, model_state, tx.init(params))


def zero_metrics() -> dict[str, jax.Array]:
    """Running sums a step adds to: summed loss, correct predictions, real examples."""
    return {name: jnp.zeros((), jnp.float32) for name in ("loss_sum", "correct", "count")}


def _batch_metrics(logits, labels, mask, loss_sum):
    correct = jnp.sum((jnp.argmax(logits, -1) == labels) * mask)
    return {"loss_sum": loss_sum, "correct": correct, "count": jnp.sum(mask)}


def _add(metrics, new):
    return jax.tree.map(jnp.add, metrics, new)


def train_step(state: TrainState, metrics: dict, batch: dict, *, model: Model,
               tx: optax.GradientTransformation, axis_name: str | None) -> tuple[TrainState, dict]:
    """One SGD step on this device's shard of a global batch.

    The book's convention: each device sums the cross-entropy over its real (mask 1)
    examples, `allreduce` sums the gradients over the devices, and the sum is divided
    by the number of real examples in the *global* batch, so every replica applies the
    same update as one device would on the whole batch. With axis_name None the same
    function is the single-device step.
    """
    x, y, mask = batch["image"], batch["label"], batch["mask"]

    def loss_fn(params):
        logits, model_state = model.apply(params, state.model_state, x, mask, train=True,
                                          axis_name=axis_name)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return jnp.sum(losses * mask), (logits, model_state)

    (loss_sum, (logits, model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params)
    new = allreduce(_batch_metrics(logits, y, mask, loss_sum), axis_name)
    grads = jax.tree.map(lambda g: g / new["count"], allreduce(grads, axis_name))
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return TrainState(params, model_state, opt_state), _add(metrics, new)


def eval_step(state: TrainState, metrics: dict, batch: dict, *, model: Model,
              axis_name: str | None) -> dict:
    """Add this shard's loss, correct count and example count, summed over the devices."""
    x, y, mask = batch["image"], batch["label"], batch["mask"]
    logits, _ = model.apply(state.params, state.model_state, x, mask, train=False,
                            axis_name=axis_name)
    loss_sum = jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, y) * mask)
    return _add(metrics, allreduce(_batch_metrics(logits, y, mask, loss_sum), axis_name))


class Steps(NamedTuple):
    """A model's train and eval steps compiled for one backend."""
    backend: Backend
    train_batch: Callable
    evaluate: Callable


def make_steps(model: Model, tx: optax.GradientTransformation, backend: Backend) -> Steps:
    """Wrap the pure steps for backend (under jax.pmap for 'pmap'); the state is donated."""
    train_fn = functools.partial(train_step, model=model, tx=tx, axis_name=backend.axis_name)
    eval_fn = functools.partial(eval_step, model=model, axis_name=backend.axis_name)
    return Steps(backend, backend.compile(train_fn, donate_argnums=(0,)),
                 backend.compile(eval_fn))


class _InFlight:
    """Blocks on the oldest dispatched step once more than MAX_IN_FLIGHT are queued."""

    def __init__(self, on_done: Callable[[int], None] = lambda n: None):
        self.pending, self.on_done = collections.deque(), on_done

    def add(self, tree, examples: int = 0):
        """Queue a step's output; wait for the oldest if too many are queued."""
        self.pending.append((tree, examples))
        while len(self.pending) > MAX_IN_FLIGHT:
            self._wait_oldest()

    def drain(self):
        """Wait for every queued step."""
        while self.pending:
            self._wait_oldest()

    def _wait_oldest(self):
        tree, examples = self.pending.popleft()
        jax.block_until_ready(tree)
        self.on_done(examples)


def evaluate(steps: Steps, state: TrainState, data: data_lib.Split, batch_size: int) -> dict:
    """Sums over every example of data, each counted once, read back to the host."""
    backend, in_flight = steps.backend, _InFlight()
    metrics = backend.replicate(zero_metrics())
    for batch in data_lib.batches(data, batch_size, num_devices=len(backend.devices)):
        metrics = steps.evaluate(state, metrics, backend.shard(batch))
        in_flight.add(metrics)
    totals = {k: float(v) for k, v in backend.unreplicate(metrics).items()}
    if totals["count"] != len(data.labels):
        raise RuntimeError(f"evaluation counted {totals['count']:.0f} of {len(data.labels)} "
                           "examples")
    return totals


def evaluate_accuracy(steps: Steps, state: TrainState, data: data_lib.Split,
                      batch_size: int = 256) -> float:
    """The book's evaluate_accuracy: correct predictions / examples, over every example."""
    totals = evaluate(steps, state, data, batch_size)
    return totals["correct"] / totals["count"]


def train_epoch(steps: Steps, state: TrainState, data: data_lib.Split, batch_size: int,
                key: jax.Array, progress: str | None = None) -> tuple[TrainState, dict]:
    """One pass over data in the order key gives; returns the state and host-side sums.

    With progress set, a bar with that label shows images/s and the time left.
    """
    backend = steps.backend
    metrics = backend.replicate(zero_metrics())
    with tqdm.tqdm(total=len(data.labels), desc=progress, unit="img", unit_scale=True,
                   leave=False, disable=progress is None) as bar:
        in_flight = _InFlight(on_done=bar.update)
        for batch in data_lib.batches(data, batch_size, num_devices=len(backend.devices),
                                      key=key):
            state, metrics = steps.train_batch(state, metrics, backend.shard(batch))
            in_flight.add(metrics, int(batch["mask"].sum()))
        in_flight.drain()
    return state, {k: float(v) for k, v in backend.unreplicate(metrics).items()}


def check_hyperparameters(batch_size: int, lr: float, epochs: int) -> None:
    """Refuse values that cannot train, with what to pass instead."""
    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"--lr must be a positive finite number, got {lr}")
    if epochs < 1:
        raise ValueError(f"--epochs must be at least 1, got {epochs}")


def train(model: Model, train_data: data_lib.Split, test_data: data_lib.Split,
          devices: Sequence[jax.Device], *, backend: str = "pmap", batch_size: int = 256,
          lr: float = 0.2, epochs: int = 4, seed: int = 0, progress: bool = False,
          log: Callable[[str], None] = print) -> dict:
    """Train model with SGD on devices, printing the book's line per epoch.

    Args:
      model: the model's pure init and apply.
      train_data, test_data: host-side splits.
      devices: the devices to train on; each global batch is split over them.
      backend: 'pmap' (the book's way) or 'single' (one device, jax.jit).
      batch_size: the global batch size, split evenly (padded) over the devices.
      lr: SGD learning rate, applied to the gradient averaged over the global batch.
      epochs: passes over train_data, each in a fresh order drawn from seed.
      seed: the one source of randomness (initial params and every epoch's order).
      progress: show a progress bar (images/s, time left) within each epoch.
      log: where the per-epoch lines go.

    Returns:
      {"devices", "batch_size", "lr", "compile_s", "epochs": [{"epoch", "time_s",
      "train_loss", "train_acc", "test_acc"}, ...]}.
    """
    check_hyperparameters(batch_size, lr, epochs)
    tx = optax.sgd(lr)
    init_key, order_key = jax.random.split(jax.random.key(seed))
    steps = make_steps(model, tx, make_backend(backend, devices))
    state = steps.backend.replicate(init_state(model, tx, init_key))

    start = time.perf_counter()
    steps = _compile(steps, state, data_lib.padded_size(batch_size, len(devices)),
                     train_data.images.shape[1:])
    compile_s = time.perf_counter() - start
    log(f"compile {compile_s:.1f} sec on {len(devices)} device(s)")

    history = []
    for epoch in range(epochs):
        start = time.perf_counter()
        state, sums = train_epoch(steps, state, train_data, batch_size,
                                  jax.random.fold_in(order_key, epoch),
                                  progress=f"epoch {epoch + 1}" if progress else None)
        time_s = time.perf_counter() - start
        test_acc = evaluate_accuracy(steps, state, test_data, batch_size)
        history.append({"epoch": epoch + 1, "time_s": time_s,
                        "train_loss": sums["loss_sum"] / sums["count"],
                        "train_acc": sums["correct"] / sums["count"], "test_acc": test_acc})
        log(f"epoch {epoch + 1}, time {time_s:.1f} sec, test acc {test_acc:.2f}")
    return {"devices": len(devices), "batch_size": batch_size, "lr": lr,
            "compile_s": compile_s, "epochs": history}


def _compile(steps: Steps, state: TrainState, size: int, image_shape) -> Steps:
    """Compile both steps ahead of time for batches of size examples."""
    backend = steps.backend
    batch = backend.shard({"image": np.zeros((size,) + image_shape, np.float32),
                           "label": np.zeros(size, np.int32), "mask": np.ones(size, np.float32)})
    metrics = backend.replicate(zero_metrics())
    return steps._replace(train_batch=steps.train_batch.lower(state, metrics, batch).compile(),
                          evaluate=steps.evaluate.lower(state, metrics, batch).compile())
