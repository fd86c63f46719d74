"""The pure train step, its evaluation twin, and the book's train() loop over any backend."""

from __future__ import annotations

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
from jax_dp import dispatch
from jax_dp.allreduce import ALLREDUCES
from jax_dp.backends import Backend, make_backend
from jax_dp.checkpoint import Checkpointer, Snapshot
from jax_dp.models import Model
from jax_dp.parallel import allreduce, reduced


class TrainState(NamedTuple):
    """Everything a step updates: params, model state (BatchNorm statistics), optimizer state."""
    params: Any
    model_state: Any
    opt_state: Any


class NonFiniteError(ValueError):
    """Loss or gradients stopped being finite numbers."""


class Interrupted(Exception):
    """SIGINT or SIGTERM stopped training between two steps."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


def init_state(model: Model, tx: optax.GradientTransformation, key: jax.Array) -> TrainState:
    """Fresh params and model state from key, with the optimizer's initial state."""
    params, model_state = model.init(key)
    return TrainState(params, model_state, tx.init(params))


def zero_metrics() -> dict[str, jax.Array]:
    """Running sums over an epoch: loss, correct predictions, real examples, steps taken,
    and the index of the first step whose loss or gradients were not finite (-1: none)."""
    sums = {name: jnp.zeros((), jnp.float32) for name in ("loss_sum", "correct", "count")}
    return {**sums, "steps": jnp.zeros((), jnp.int32), "first_bad": -jnp.ones((), jnp.int32)}


def _batch_metrics(logits, labels, mask, loss_sum):
    correct = jnp.sum((jnp.argmax(logits, -1) == labels) * mask)
    return {"loss_sum": loss_sum, "correct": correct, "count": jnp.sum(mask)}


def _add(metrics, new):
    return {**metrics, **{k: metrics[k] + v for k, v in new.items()}}


def train_step(state: TrainState, metrics: dict, batch: dict, *, model: Model,
               tx: optax.GradientTransformation, axis_name: str | None,
               grad_allreduce: Callable = allreduce) -> tuple[TrainState, dict]:
    """One SGD step on this device's shard of a global batch.

    The book's convention: each device sums the cross-entropy over its real (mask 1)
    examples, `allreduce` sums the gradients over the devices, and the sum is divided
    by the number of real examples in the *global* batch, so every replica applies the
    same update as one device would on the whole batch (grad_allreduce may be one of
    jax_dp.allreduce's hand-made ones). With axis_name None the same function is the
    single-device step. Once a step's loss or gradients are not finite,
    this and later steps of the epoch leave the state as it was (metrics say where).
    """
    x, y, mask = batch["image"], batch["label"], batch["mask"]

    def loss_fn(params):
        logits, model_state = model.apply(params, state.model_state, x, mask, train=True,
                                          axis_name=axis_name)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return jnp.sum(losses * mask), (logits, model_state)

    (loss_sum, (logits, model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        reduced(state.params, axis_name, x))
    new = allreduce(_batch_metrics(logits, y, mask, loss_sum), axis_name)
    if axis_name is not None:
        grads = grad_allreduce(grads, axis_name)
    grads = jax.tree.map(lambda g: g / new["count"], grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    stepped = TrainState(optax.apply_updates(state.params, updates), model_state, opt_state)

    finite = jnp.isfinite(new["loss_sum"]) & jnp.all(
        jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    good = finite & (metrics["first_bad"] < 0)
    state = jax.tree.map(lambda a, b: jnp.where(good, a, b), stepped, state)
    metrics = _add(metrics, new)
    return state, {**metrics, "steps": metrics["steps"] + 1, "first_bad": jnp.where(
        ~finite & (metrics["first_bad"] < 0), metrics["steps"], metrics["first_bad"])}


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


def make_steps(model: Model, tx: optax.GradientTransformation, backend: Backend,
               grad_allreduce: str = "psum") -> Steps:
    """Wrap the pure steps for backend (under jax.pmap for 'pmap'); the state is donated.

    grad_allreduce: how the step sums gradients: 'psum', or by hand ('star', 'ring').
    """
    if grad_allreduce not in ALLREDUCES:
        raise ValueError(f"unknown --allreduce {grad_allreduce!r}: use one of {', '.join(ALLREDUCES)}")
    if grad_allreduce != "psum" and backend.name != "pmap":
        raise ValueError(f"--allreduce {grad_allreduce} is written for the pmap backend; "
                         "use --backend pmap")
    train_fn = functools.partial(train_step, model=model, tx=tx, axis_name=backend.axis_name,
                                 grad_allreduce=ALLREDUCES[grad_allreduce])
    eval_fn = functools.partial(eval_step, model=model, axis_name=backend.axis_name)
    return Steps(backend, backend.compile(train_fn, donate_argnums=(0,)),
                 backend.compile(eval_fn))


def evaluate(steps: Steps, state: TrainState, data: data_lib.Split, batch_size: int) -> dict:
    """Sums over every example of data, each counted once, read back to the host."""
    backend, in_flight = steps.backend, dispatch.InFlight()
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
                order: np.ndarray, *, metrics: dict | None = None, start: int = 0,
                drop_remainder: bool = False, progress: str | None = None,
                on_step: Callable[[int, TrainState, dict], bool] | None = None,
                step_timeout: float | None = None) -> tuple[TrainState, dict]:
    """Steps over data in `order`, from batch `start`; returns the state and device-side sums.

    on_step(i, state, metrics) runs after batch i (1-based) is dispatched and may end the
    epoch early by returning True. With progress set, a bar with that label shows images/s
    and the time left.
    """
    backend = steps.backend
    metrics = backend.replicate(zero_metrics()) if metrics is None else metrics
    total = data_lib.num_batches(len(data.labels), batch_size, drop_remainder)
    with tqdm.tqdm(total=total, initial=start, desc=progress, unit="batch", leave=False,
                   disable=progress is None) as bar:
        in_flight = dispatch.InFlight(lambda out, info: bar.update(), step_timeout)
        batches = data_lib.batches(data, batch_size, num_devices=len(backend.devices),
                                   order=order, start=start, drop_remainder=drop_remainder)
        for i, batch in enumerate(batches, start + 1):
            state, metrics = steps.train_batch(state, metrics, backend.shard(batch))
            in_flight.add(metrics, f"step {i} of {progress or 'the epoch'}")
            if on_step is not None and on_step(i, state, metrics):
                break
        in_flight.drain()
    return state, metrics


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
          lr: float = 0.2, epochs: int = 4, seed: int = 0, drop_remainder: bool = False,
          checkpoint_dir: str | None = None, checkpoint_every: int = 0, resume: bool = False,
          step_timeout: float | None = None, progress: bool = False, name: str = "",
          grad_allreduce: str = "psum", warmup_epochs: float = 0.0,
          log: Callable[[str], None] = print) -> dict:
    """Train model with SGD on devices, printing the book's line per epoch.

    Args:
      model: the model's pure init and apply.
      train_data, test_data: host-side splits.
      devices: the devices to train on; each global batch is split over them.
      backend: 'pmap' (the book's way), 'shard_map', 'jit' (NamedSharding) or 'single'
        (one device).
      batch_size: the global batch size, split evenly (padded) over the devices.
      lr: SGD learning rate, applied to the gradient averaged over the global batch.
      epochs: passes over train_data, each in a fresh order drawn from seed.
      seed: the one source of randomness (initial params and every epoch's order).
      drop_remainder: skip each epoch's last partial batch (the book's DataLoader keeps it).
      checkpoint_dir: save the run here (Orbax) every checkpoint_every steps and at
        each epoch's end; on SIGINT or SIGTERM, save and raise Interrupted.
      resume: continue from the latest checkpoint in checkpoint_dir, if there is one.
      step_timeout: end the process (exit code 3) if a step takes longer than this.
      progress: show a progress bar (images/s, time left) within each epoch.
      name: the model's name, recorded in checkpoints so a resume cannot mix models.
      grad_allreduce: 'psum', or the hand-made 'star' (the book's) or 'ring' (pmap only).
      warmup_epochs: raise the learning rate linearly from 0 to lr over this many epochs.
      log: where the per-epoch lines go.

    Returns:
      {"devices", "batch_size", "lr", "compile_s", "epochs": [{"epoch", "time_s",
      "train_loss", "train_acc", "test_acc"}, ...], "state": the final TrainState on the
      host (replica 0)}.
    """
    check_hyperparameters(batch_size, lr, epochs)
    if checkpoint_every < 0:
        raise ValueError(f"--checkpoint-every must be 0 (epoch ends only) or more, got {checkpoint_every}")
    if (resume or checkpoint_every) and not checkpoint_dir:
        raise ValueError("--resume and --checkpoint-every need --checkpoint-dir")
    if warmup_epochs < 0:
        raise ValueError(f"--warmup-epochs must be 0 or more, got {warmup_epochs}")
    n = len(train_data.labels)
    warmup_steps = round(warmup_epochs * data_lib.num_batches(n, batch_size, drop_remainder))
    tx = optax.sgd(optax.linear_schedule(0.0, lr, warmup_steps) if warmup_steps else lr)
    key = jax.random.key(seed)
    init_key, order_key = jax.random.split(key)
    steps = make_steps(model, tx, make_backend(backend, devices), grad_allreduce)
    dp = steps.backend
    state = dp.replicate(init_state(model, tx, init_key))
    config = {"model": name, "backend": backend, "devices": len(devices), "batch_size": batch_size,
              "lr": lr, "seed": seed, "drop_remainder": drop_remainder, "train_examples": n,
              "warmup_steps": warmup_steps}
    ckpt = Checkpointer(checkpoint_dir, config) if checkpoint_dir else None
    epoch, start, history, metrics, order, global_step = 0, 0, [], None, None, 0
    snapshot = ckpt.restore(_snapshot(dp, state, dp.replicate(zero_metrics()), np.arange(n),
                                      key, 0, 0, 0, [])) if ckpt and resume else None
    if snapshot is not None:
        state = TrainState(dp.replicate(snapshot.state["params"]),
                           dp.from_host(snapshot.state["model_state"]),
                           dp.replicate(snapshot.state["opt_state"]))
        metrics, order = dp.replicate(snapshot.metrics), snapshot.order
        epoch, start, history = snapshot.epoch, snapshot.step, snapshot.history
        global_step, key = snapshot.global_step, jax.random.wrap_key_data(snapshot.key)
        order_key = jax.random.split(key)[1]
        log(f"resuming from {checkpoint_dir} at epoch {epoch + 1}, step {start}")

    start_time = time.perf_counter()
    steps = _compile(steps, state, data_lib.padded_size(batch_size, len(devices)),
                     train_data.images.shape[1:])
    compile_s = time.perf_counter() - start_time
    log(f"compile {compile_s:.1f} sec on {len(devices)} device(s)")

    def save(state, metrics, order, epoch, step):
        ckpt.save(_snapshot(dp, state, metrics, order, key, epoch, step, global_step + step - start,
                            history))

    with dispatch.stop_requests() as stop:
        while epoch < epochs:
            if order is None:
                order = data_lib.epoch_order(n, jax.random.fold_in(order_key, epoch))

            def on_step(i, state, metrics):
                if (ckpt and checkpoint_every and (global_step + i - start) % checkpoint_every == 0) \
                        or stop.signum is not None:
                    _check_finite(dp, metrics, epoch)
                    if ckpt:
                        save(state, metrics, order, epoch, i)
                if stop.signum is not None:
                    where = f"epoch {epoch + 1}, step {i}"
                    saved = (f"checkpoint saved in {checkpoint_dir}: rerun with --resume"
                             if ckpt else "no --checkpoint-dir, so nothing was saved")
                    raise Interrupted(stop.signum, f"interrupted at {where}; {saved}")
                return False

            epoch_start = time.perf_counter()
            state, metrics = train_epoch(
                steps, state, train_data, batch_size, order, metrics=metrics, start=start,
                drop_remainder=drop_remainder, on_step=on_step, step_timeout=step_timeout,
                progress=f"epoch {epoch + 1}" if progress else None)
            time_s = time.perf_counter() - epoch_start
            sums = _check_finite(dp, metrics, epoch)
            global_step += int(sums["steps"]) - start
            test_acc = evaluate_accuracy(steps, state, test_data, batch_size)
            history.append({"epoch": epoch + 1, "time_s": time_s,
                            "train_loss": sums["loss_sum"] / sums["count"],
                            "train_acc": sums["correct"] / sums["count"], "test_acc": test_acc})
            log(f"epoch {epoch + 1}, time {time_s:.1f} sec, test acc {test_acc:.2f}")
            epoch, start, metrics, order = epoch + 1, 0, None, None
            if ckpt:
                next_order = data_lib.epoch_order(n, jax.random.fold_in(order_key, epoch))
                ckpt.save(_snapshot(dp, state, dp.replicate(zero_metrics()), next_order, key,
                                    epoch, 0, global_step, history))
    if ckpt:
        ckpt.close()
    return {"devices": len(devices), "batch_size": batch_size, "lr": lr,
            "compile_s": compile_s, "epochs": history, "state": dp.unreplicate(state)}


def _check_finite(backend: Backend, metrics: dict, epoch: int) -> dict:
    """The epoch's sums on the host; NonFiniteError if a step went non-finite."""
    sums = {k: v.item() for k, v in backend.unreplicate(metrics).items()}
    if sums["first_bad"] >= 0:
        raise NonFiniteError(
            f"loss or gradients became non-finite at epoch {epoch + 1}, step "
            f"{sums['first_bad'] + 1}; training stopped with the last good state "
            "(and checkpoint): lower --lr")
    return sums


def _snapshot(backend, state, metrics, order, key, epoch, step, global_step, history) -> Snapshot:
    """A host-side Snapshot of a placed state and metrics."""
    host = {"params": backend.unreplicate(state.params),
            "model_state": backend.to_host(state.model_state),
            "opt_state": backend.unreplicate(state.opt_state)}
    return Snapshot(host, backend.unreplicate(metrics), np.asarray(order),
                    np.asarray(jax.random.key_data(key)), epoch, step, global_step, list(history))


def _compile(steps: Steps, state: TrainState, size: int, image_shape) -> Steps:
    """Compile both steps ahead of time for batches of size examples."""
    backend = steps.backend
    batch = backend.shard({"image": np.zeros((size,) + image_shape, np.float32),
                           "label": np.zeros(size, np.int32), "mask": np.ones(size, np.float32)})
    metrics = backend.replicate(zero_metrics())
    train_batch = steps.train_batch.lower(state, metrics, batch).compile()
    evaluate = steps.evaluate.lower(state, metrics, batch).compile()
    if jax.process_count() > 1:
        # pmap's compiled form cannot take process-local arrays: keep the wrapped steps,
        # which find these executables in JAX's compilation cache.
        return steps
    return steps._replace(train_batch=train_batch, evaluate=evaluate)
