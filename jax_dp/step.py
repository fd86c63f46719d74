"""The book's data-parallel step: each device's gradient on its shard, summed by an all-reduce."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jax_dp.models.model import Model
from jax_dp.parallel import allreduce, allreduce_flat


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
    """Running sums over an epoch: loss, correct predictions, real examples, steps taken,
    the index of the first step whose loss or gradients were not finite (-1: none) and what
    was not finite in it (0: the loss, i + 1: the gradient of the params' leaf i)."""
    sums = {name: jnp.zeros((), jnp.float32) for name in ("loss_sum", "correct", "count")}
    return {**sums, "steps": jnp.zeros((), jnp.int32), "first_bad": -jnp.ones((), jnp.int32),
            "bad_part": -jnp.ones((), jnp.int32)}


def batch_metrics(logits, labels, mask, loss_sum):
    correct = jnp.sum((jnp.argmax(logits, -1) == labels) * mask)
    return {"loss_sum": loss_sum, "correct": correct, "count": jnp.sum(mask)}


def example_metrics(logits, labels, mask):
    """batch_metrics with the loss sum taken from the logits: the cross-entropy over real rows."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return batch_metrics(logits, labels, mask, jnp.sum(losses * mask))


def add_metrics(metrics, new):
    return {**metrics, **{k: metrics[k] + v for k, v in new.items()}}


def train_step(state: TrainState, metrics: dict, batch: dict, *, model: Model,
               tx: optax.GradientTransformation, axis_name: str | None,
               grad_allreduce: Callable = allreduce_flat) -> tuple[TrainState, dict]:
    """One SGD step on this device's shard of a global batch.

    The book's convention: each device sums the cross-entropy over its real (mask 1)
    examples, `grad_allreduce` sums the gradients (and the metrics) over the devices, and
    the sum is divided by the number of real examples in the *global* batch, so every
    replica applies the same update as one device would on the whole batch. With
    axis_name None the same function is the single-device step. Once a step's loss or
    gradients are not finite, this and later steps of the epoch leave the state as it was
    (metrics say where).
    """
    x, y, mask = batch["image"], batch["label"], batch["mask"]

    def loss_fn(params):
        logits, model_state = model.apply(params, state.model_state, x, mask, train=True,
                                          axis_name=axis_name)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return jnp.sum(losses * mask), (logits, model_state)

    (loss_sum, (logits, model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    # The all-reduce: lax.psum of this device's gradients and metrics over the devices.
    grads, new = grad_allreduce((grads, batch_metrics(logits, y, mask, loss_sum)), axis_name)
    return apply_gradients(state, metrics, grads, new, model_state, tx)


def apply_gradients(state: TrainState, metrics: dict, grads: Any, new: dict, model_state: Any,
                    tx: optax.GradientTransformation) -> tuple[TrainState, dict]:
    """The update from the global batch's summed gradients and metrics (`new`): SGD on their
    mean over the real examples, unless they are not finite (then state stays, metrics say where)."""
    grads = jax.tree.map(lambda g: g / new["count"], grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    stepped = TrainState(optax.apply_updates(state.params, updates), model_state, opt_state)

    finite_parts = jnp.array([jnp.isfinite(new["loss_sum"])]
                             + [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])
    finite, first = jnp.all(finite_parts), metrics["first_bad"] < 0
    state = jax.tree.map(lambda a, b: jnp.where(finite & first, a, b), stepped, state)
    metrics, bad = add_metrics(metrics, new), ~finite & first
    return state, {**metrics, "steps": metrics["steps"] + 1,
                   "first_bad": jnp.where(bad, metrics["steps"], metrics["first_bad"]),
                   "bad_part": jnp.where(bad, jnp.argmin(finite_parts), metrics["bad_part"])}


def eval_step(state: TrainState, metrics: dict, batch: dict, *, model: Model,
              axis_name: str | None) -> dict:
    """Add this shard's loss, correct count and example count, summed over the devices."""
    x, y, mask = batch["image"], batch["label"], batch["mask"]
    logits, _ = model.apply(state.params, state.model_state, x, mask, train=False,
                            axis_name=axis_name)
    return add_metrics(metrics, allreduce(example_metrics(logits, y, mask), axis_name))


class Steps(NamedTuple):
    """A model's pure steps for one shard, each taking (state, metrics, batch), for a Program to
    compile: every global batch is padded to a multiple of `pad_to` rows (None: the device
    count)."""
    train_step: Callable
    eval_step: Callable | None = None
    pad_to: int | None = None


def make_steps(model: Model, tx: optax.GradientTransformation, axis_name: str | None,
               grad_allreduce: Callable = allreduce_flat) -> Steps:
    """The book's steps over axis_name (None: one device, no collectives).

    grad_allreduce: how the step sums gradients and metrics (allreduce_flat: one lax.psum;
    jax_dp.schemes has the hand-made ones).
    """
    return Steps(functools.partial(train_step, model=model, tx=tx, axis_name=axis_name,
                                   grad_allreduce=grad_allreduce),
                 functools.partial(eval_step, model=model, axis_name=axis_name))
