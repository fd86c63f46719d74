"""The pure train step, its evaluation twin, and the book's train() loop over any backend."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

from jax_dp import data as data_lib
from jax_dp import dispatch, loop
from jax_dp.allreduce import get_allreduce
from jax_dp.backends import Backend, make_backend
from jax_dp.checkpoint import Checkpointer, Record
from jax_dp.config import TrainConfig
from jax_dp.devices import get_devices
from jax_dp.errors import ParamError
from jax_dp.models import Model, get_model
from jax_dp.parallel import allreduce, reduced


class TrainState(NamedTuple):
    """Everything a step updates: params, model state (BatchNorm statistics), optimizer state."""
    params: Any
    model_state: Any
    opt_state: Any


class NonFiniteError(ParamError):
    """Loss or gradients stopped being finite numbers."""


class Interrupted(Exception):
    """SIGINT or SIGTERM stopped training between two steps; `saved` is the checkpoint's folder."""

    def __init__(self, signum: int, where: str, saved: str | None):
        super().__init__(f"interrupted at {where}; " + (f"checkpoint saved in {saved}" if saved
                                                         else "nothing saved"))
        self.signum, self.saved = signum, saved


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
    """A model's train and eval steps compiled for one backend; train_calls(state, metrics,
    split, call) runs loop.calls' steps in one call."""
    backend: Backend
    train_batch: Callable
    evaluate: Callable
    train_calls: Callable


def make_steps(model: Model, tx: optax.GradientTransformation, backend: Backend,
               grad_allreduce: str = "psum") -> Steps:
    """Wrap the pure steps for backend (under jax.pmap for 'pmap'); the state is donated.

    grad_allreduce: how the step sums gradients: 'psum', or by hand ('star', 'ring').
    """
    train_fn = functools.partial(train_step, model=model, tx=tx, axis_name=backend.axis_name,
                                 grad_allreduce=get_allreduce(grad_allreduce, backend.name))
    eval_fn = functools.partial(eval_step, model=model, axis_name=backend.axis_name)
    return Steps(backend, backend.compile(train_fn, donate_argnums=(0,)),
                 backend.compile(eval_fn),
                 backend.compile(loop.scanned(train_fn), donate_argnums=(0,), replicated=3))


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


def optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """SGD at config.lr, reached linearly from 0 over config.warmup_epochs."""
    per_epoch = data_lib.num_batches(config.train_examples, config.batch_size, config.drop_remainder)
    warmup_steps = round(config.warmup_epochs * per_epoch)
    return optax.sgd(optax.linear_schedule(0.0, config.lr, warmup_steps) if warmup_steps
                     else config.lr)


def epoch_order(config: TrainConfig, key: jax.Array, epoch: int) -> np.ndarray:
    """Epoch epoch's order of the training examples, drawn from the run's key."""
    return data_lib.epoch_order(config.train_examples,
                                jax.random.fold_in(jax.random.split(key)[1], epoch))


def train(config: TrainConfig, train_data: data_lib.Split, test_data: data_lib.Split, *,
          checkpoint_dir: str | None = None, checkpoint_every: int = 0, resume: bool = False,
          step_timeout: float | None = None, progress: bool = False, steps_per_call: int = 1,
          log: Callable[[str], None] = print,
          on_epoch: Callable[[dict], None] = lambda summary: None) -> dict:
    """Train config's model with SGD on config.devices devices, printing the book's lines.

    Args:
      config: what the run computes (model, backend, devices, batch size, lr, ...);
        train_data and test_data must hold config.train_examples and test_examples.
      checkpoint_dir: save the run here (Orbax) every checkpoint_every global steps and
        at each epoch's end; on SIGINT or SIGTERM, save and raise Interrupted (a signal
        on an epoch's last step lets that epoch's evaluation finish first).
      resume: continue from the latest checkpoint in checkpoint_dir, if there is one;
        a checkpoint of another config is refused (a larger config.epochs is allowed).
      step_timeout: end the process (exit code 3) if a step takes longer than this (a call
        of steps_per_call steps, steps_per_call times this).
      progress: show a progress bar (steps/s, time left) within each epoch, on terminals only.
      steps_per_call: run this many steps per compiled call, under lax.scan, the training
        split held on the devices (the same numbers as one step per call). Checkpoints,
        signals and the progress bar then act between calls: a save falls at the end of the
        first call at or past each multiple of checkpoint_every.
      log: where the config, compile time and per-epoch lines go.
      on_epoch: called after each epoch's evaluation with the run's summary so far (the
        return value without "state"), before that epoch's checkpoint and any stop.

    Returns:
      {"config": the config as a dict, "steps_per_call", "compile_s", "epochs": [{"epoch", "time_s",
      "train_loss", "train_acc", "test_acc"}, ...], "state": the final TrainState on the
      host (replica 0)}.
    """
    _check_run(config, train_data, test_data, checkpoint_dir, checkpoint_every, resume,
               steps_per_call)
    log(f"config: {config}")
    model, tx, key = get_model(config.model, **config.model_options()), optimizer(config), \
        jax.random.key(config.seed)
    steps = make_steps(model, tx, make_backend(config.backend, get_devices(config.devices)),
                       config.allreduce)
    dp = steps.backend
    state = dp.replicate(init_state(model, tx, jax.random.split(key)[0]))
    metrics, record = dp.replicate(zero_metrics()), Record(0, 0, 0, epoch_order(config, key, 0), key)
    ckpt = Checkpointer(checkpoint_dir, config, dp) if checkpoint_dir else None
    if resume and (restored := ckpt.restore(state, metrics, record)) is not None:
        state, metrics, record = restored
        log(f"resuming from {checkpoint_dir} at epoch {record.epoch + 1}, step {record.step}")
    per_epoch = data_lib.num_batches(config.train_examples, config.batch_size, config.drop_remainder)
    split = dp.replicate(loop.on_device(train_data)) if steps_per_call > 1 else None
    start_time = time.perf_counter()
    steps, calls = _compile(steps, state, data_lib.padded_size(config.batch_size, config.devices),
                            train_data.images.shape[1:], split,
                            _call_lengths(per_epoch, steps_per_call, record.step))
    compile_s = time.perf_counter() - start_time

    def summary() -> dict:  # Reads record when called: the history so far.
        return {"config": dataclasses.asdict(config), "steps_per_call": steps_per_call,
                "compile_s": compile_s, "epochs": list(record.history)}

    log(f"compile {compile_s:.1f} sec on {config.devices} device(s)")

    in_flight = dispatch.InFlight(timeout_s=step_timeout and step_timeout * steps_per_call)
    with dispatch.stop_requests() as stop:
        while record.epoch < config.epochs:
            epoch_start = time.perf_counter() - record.epoch_s  # A resumed epoch's earlier steps.
            with _bar(progress, record, per_epoch) as bar:
                for n, batch in _epoch(config, train_data, record, steps_per_call):
                    state, metrics = (
                        calls[n](state, metrics, split, dp.shard(batch)) if split is not None
                        else steps.train_batch(state, metrics, dp.shard(batch)))
                    before, record = record.global_step, record.stepped(n)
                    in_flight.add(metrics, f"step {record.step} of epoch {record.epoch + 1}")
                    bar.update(n)
                    if record.step < per_epoch:  # An epoch's last step is saved at its end.
                        _between_steps(dp, ckpt, state, metrics, record, stop, due=bool(
                            checkpoint_every and record.global_step // checkpoint_every
                            > before // checkpoint_every), epoch_start=epoch_start)
                in_flight.drain()
            time_s = time.perf_counter() - epoch_start
            sums = _check_finite(dp, metrics, record)
            test_acc = evaluate_accuracy(steps, state, test_data, config.batch_size)
            log(f"epoch {record.epoch + 1}, time {time_s:.1f} sec, test acc {test_acc:.2f}")
            record = record.next_epoch(
                {"epoch": record.epoch + 1, "time_s": time_s, "test_acc": test_acc,
                 "train_loss": sums["loss_sum"] / sums["count"],
                 "train_acc": sums["correct"] / sums["count"]},
                epoch_order(config, record.key, record.epoch + 1))
            metrics = dp.replicate(zero_metrics())
            on_epoch(summary())
            _between_steps(dp, ckpt, state, metrics, record, stop, due=True,
                           finished=record.epoch == config.epochs)
    if ckpt:
        ckpt.close()
    return {**summary(), "state": dp.unreplicate(state)}


def _epoch(config: TrainConfig, train_data: data_lib.Split, record: Record, steps_per_call: int):
    """The epoch's steps from record.step on, as (steps, batch) pairs: host batches one step
    at a time, or loop.calls' index batches of up to steps_per_call steps."""
    where = dict(num_devices=config.devices, order=record.order, start=record.step,
                 drop_remainder=config.drop_remainder)
    if steps_per_call == 1:
        return ((1, batch) for batch in data_lib.batches(train_data, config.batch_size, **where))
    return ((call["mask"].shape[1], call) for call in
            loop.calls(len(train_data.labels), config.batch_size, steps_per_call, **where))


def _call_lengths(per_epoch: int, steps_per_call: int, start: int) -> set[int]:
    """The numbers of steps the calls of an epoch take, that one resumed at step start included."""
    if steps_per_call == 1:
        return set()
    return {min(steps_per_call, per_epoch - first) for begin in {0, start}
            for first in range(begin, per_epoch, steps_per_call)}


def _check_run(config, train_data, test_data, checkpoint_dir, checkpoint_every, resume,
               steps_per_call=1):
    """Refuse data that is not the config's, and options that cannot work."""
    loop.check_steps_per_call(steps_per_call)
    for split, data in (("train", train_data), ("test", test_data)):
        if len(data.labels) != getattr(config, f"{split}_examples"):
            raise ParamError(f"{split}_examples", f"{{}} is {getattr(config, f'{split}_examples')}"
                             f" but the {split} data holds {len(data.labels)} examples")
    if checkpoint_every < 0:
        raise ParamError("checkpoint_every", f"{{}} must be 0 (epoch ends only) or more, "
                         f"got {checkpoint_every}")
    if (resume or checkpoint_every) and not checkpoint_dir:
        raise ParamError(("resume", "checkpoint_every", "checkpoint_dir"), "{} and {} need {}")


def _bar(progress: bool, record: Record, total: int) -> tqdm.tqdm:
    """A progress bar over an epoch's steps, shown only on a terminal (None: tqdm's TTY test)."""
    return tqdm.tqdm(total=total, initial=record.step, desc=f"epoch {record.epoch + 1}",
                     unit="batch", leave=False, disable=None if progress else True)


def _between_steps(backend: Backend, ckpt: Checkpointer | None, state, metrics, record: Record,
                   stop, *, due: bool, finished: bool = False,
                   epoch_start: float | None = None) -> None:
    """The periodic actions: save when due or asked to stop, then stop if asked (unless finished).
    Mid-epoch (epoch_start given), the save keeps the seconds the epoch's steps took so far."""
    stopping = stop.signum is not None and not finished
    if not (due or stopping):
        return
    _check_finite(backend, metrics, record)  # Never save, nor stop quietly, past a bad step.
    if epoch_start is not None:  # After _check_finite waited for the steps.
        record = record._replace(epoch_s=time.perf_counter() - epoch_start)
    if ckpt:
        ckpt.save(state, metrics, record)
    if stopping:
        where = f"epoch {record.epoch + 1}, step {record.step}"
        raise Interrupted(stop.signum, where, str(ckpt.directory) if ckpt else None)


def _check_finite(backend: Backend, metrics: dict, record: Record) -> dict:
    """The epoch's sums on the host; NonFiniteError if a step went non-finite."""
    sums = {k: v.item() for k, v in backend.unreplicate(metrics).items()}
    if sums["first_bad"] >= 0:
        raise NonFiniteError("lr", (
            f"loss or gradients became non-finite at epoch {record.epoch + 1}, step "
            f"{sums['first_bad'] + 1}; training stopped with the last good state "
            "(and checkpoint): lower {}"))
    return sums


def _compile(steps: Steps, state: TrainState, size: int, image_shape, split=None,
             call_lengths: set[int] = frozenset()) -> tuple[Steps, dict[int, Callable]]:
    """Compile the steps ahead of time for batches of size examples, and train_calls for
    calls of each of call_lengths steps over split; returns the steps and {length: call}."""
    backend = steps.backend
    batch = backend.shard(data_lib.zero_batch(size, image_shape))
    metrics = backend.replicate(zero_metrics())
    train_batch = steps.train_batch if split is not None else \
        steps.train_batch.lower(state, metrics, batch).compile()
    evaluate = steps.evaluate.lower(state, metrics, batch).compile()
    calls = {n: steps.train_calls.lower(state, metrics, split, backend.shard(
        {"index": np.zeros((size, n), np.int32), "mask": np.ones((size, n), np.float32)}))
        .compile() for n in call_lengths}
    if jax.process_count() > 1:
        # pmap's compiled form cannot take process-local arrays: keep the wrapped steps,
        # which find these executables in JAX's compilation cache.
        return steps, {n: steps.train_calls for n in call_lengths}
    return steps._replace(train_batch=train_batch, evaluate=evaluate), calls
