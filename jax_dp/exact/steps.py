"""The exact mode's steps: step.train_step and eval_step with every sum over examples in the tree."""

from __future__ import annotations

import functools

import jax
import optax
from jax import lax

from jax_dp.config import MICRO_BATCHES
from jax_dp.errors import ParamError
from jax_dp.exact.layers import on_micro_batches
from jax_dp.exact.micro import Parts, doubling_sum, total, tree_sum
from jax_dp.models.model import Model
from jax_dp.step import Steps, TrainState, add_metrics, apply_gradients, example_metrics


def _per_device(axis_name: str | None) -> int:
    return MICRO_BATCHES // (1 if axis_name is None else lax.axis_size(axis_name))


def _each(fn, n, *rows):
    """fn of each of the n micro-batches of rows (arrays of this device's rows), stacked."""
    first, *others = (Parts.split(r, n) for r in rows)
    return first.each(fn, *others)


def _model_whole(state, batch, model, n):
    """Gradients and metrics of each micro-batch, the model run on it whole (stacked)."""
    def one(x, labels, mask):
        def loss_fn(params):
            logits, _ = model.apply(params, state.model_state, x, mask, train=True,
                                    axis_name=None)
            new = example_metrics(logits, labels, mask)
            return new["loss_sum"], new
        return jax.grad(loss_fn, has_aux=True)(state.params)
    grads, new = _each(one, n, batch["image"], batch["label"], batch["mask"])
    return tree_sum(grads), new, state.model_state


def _layer_by_layer(state, batch, model, n, axis_name):
    """This device's gradients (its micro-batches' tree), each micro-batch's metrics (stacked)
    and the new model state, every layer run per micro-batch (layers.on_micro_batches)."""
    labels, mask = batch["label"], batch["mask"]
    micro_model = on_micro_batches(model, n)

    def loss_fn(params):
        logits, model_state = micro_model.apply(params, state.model_state, batch["image"], mask,
                                                train=True, axis_name=axis_name)
        new = _each(example_metrics, n, logits, labels, mask)
        return tree_sum(new["loss_sum"]), (new, model_state)
    grads, (new, model_state) = jax.grad(loss_fn, has_aux=True)(state.params)
    return grads, new, model_state


def train_step(state: TrainState, metrics: dict, batch: dict, *, model: Model,
               tx: optax.GradientTransformation, axis_name: str | None) -> tuple[TrainState, dict]:
    """step.train_step with every sum over examples in the fixed tree."""
    n = _per_device(axis_name)
    if model.module is not None:
        grads, new, model_state = _layer_by_layer(state, batch, model, n, axis_name)
    else:
        grads, new, model_state = _model_whole(state, batch, model, n)
    new = total(new, axis_name)
    if axis_name is not None:
        grads = doubling_sum(grads, axis_name)
    return apply_gradients(state, metrics, grads, new, model_state, tx)


def eval_step(state: TrainState, metrics: dict, batch: dict, *, model: Model,
              axis_name: str | None) -> dict:
    """step.eval_step on micro-batches, its sums in the fixed tree."""
    n = _per_device(axis_name)
    x, labels, mask = batch["image"], batch["label"], batch["mask"]
    if model.module is not None:
        logits, _ = on_micro_batches(model, n).apply(state.params, state.model_state, x, mask,
                                                     train=False, axis_name=axis_name)
        new = _each(example_metrics, n, logits, labels, mask)
    else:
        new = _each(lambda x, labels, mask: example_metrics(model.apply(
            state.params, state.model_state, x, mask, train=False, axis_name=None)[0],
            labels, mask), n, x, labels, mask)
    return add_metrics(metrics, total(new, axis_name))


def make_steps(model: Model, tx: optax.GradientTransformation, axis_name: str | None) -> Steps:
    """step.make_steps' Steps in the exact mode: each global batch padded to MICRO_BATCHES
    rows' multiple, its sums in the tree (the config has checked the rest: config.check_exact)."""
    if model.module is None and jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0))[1]):
        raise ParamError(("exact", "model"), "{} needs a {} with batch statistics to run each "
                         "layer on micro-batches (Model.module; resnet18 has one with bn sync)")
    return Steps(functools.partial(train_step, model=model, tx=tx, axis_name=axis_name),
                 functools.partial(eval_step, model=model, axis_name=axis_name), MICRO_BATCHES)
