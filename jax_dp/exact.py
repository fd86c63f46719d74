"""The exact mode: the same float32 bits on 1, 2, 4 or 8 devices.

A sum of floats depends on its order, and `lax.psum`'s order is unspecified. Here every sum
over examples is taken in one order that does not depend on the device count: the global batch
is cut into MICRO_BATCHES micro-batches of m examples (padding rows at fixed global positions),
each micro-batch is computed alone (every product on exactly m examples, so XLA picks the same
kernels for any k), and the per-micro-batch results are added in one balanced binary tree in
global micro-batch order: its lower levels on each device, its upper levels across devices by
recursive doubling (jax_dp.micro). One device computes the same tree.

A model without batch statistics is run whole on each micro-batch. BatchNorm ties a batch's
examples together, so a model with it runs each layer on the micro-batches instead (its
apply's `micro`), its statistics summed in the same tree.
"""

from __future__ import annotations

import jax
import optax
from jax import lax

from jax_dp import micro
from jax_dp.config import MICRO_BATCHES
from jax_dp.models.model import Model
from jax_dp.step import TrainState, add_metrics, apply_gradients, apply_model, example_metrics


def _per_device(axis_name: str | None) -> int:
    return MICRO_BATCHES // (1 if axis_name is None else lax.axis_size(axis_name))


def _each(fn, n, *rows):
    """fn of each of the n micro-batches of rows (arrays of this device's rows), stacked."""
    return micro.each(fn, *(micro.split(r, n) for r in rows))


def _model_whole(state, batch, model, n, compute_dtype):
    """Gradients and metrics of each micro-batch, the model run on it whole (stacked)."""
    def one(x, labels, mask):
        def loss_fn(params):
            logits, _ = apply_model(model, params, state.model_state, x, mask, compute_dtype,
                                    train=True, axis_name=None)
            new = example_metrics(logits, labels, mask)
            return new["loss_sum"], new
        return jax.grad(loss_fn, has_aux=True)(state.params)
    grads, new = _each(one, n, batch["image"], batch["label"], batch["mask"])
    return micro.tree_sum(grads), new, state.model_state


def _layer_by_layer(state, batch, model, n, axis_name, compute_dtype):
    """This device's gradients (its micro-batches' tree), each micro-batch's metrics (stacked)
    and the new model state, every layer run per micro-batch (the model's `micro`)."""
    labels, mask = batch["label"], batch["mask"]

    def loss_fn(params):
        logits, model_state = apply_model(model, params, state.model_state, batch["image"], mask,
                                          compute_dtype, train=True, axis_name=axis_name, micro=n)
        new = _each(example_metrics, n, logits, labels, mask)
        return micro.tree_sum(new["loss_sum"]), (new, model_state)
    grads, (new, model_state) = jax.grad(loss_fn, has_aux=True)(state.params)
    return grads, new, model_state


def train_step(state: TrainState, metrics: dict, batch: dict, *, model: Model,
               tx: optax.GradientTransformation, axis_name: str | None,
               compute_dtype: str = "float32") -> tuple[TrainState, dict]:
    """step.train_step with every sum over examples in the fixed tree."""
    n = _per_device(axis_name)
    if model.micro:
        grads, new, model_state = _layer_by_layer(state, batch, model, n, axis_name, compute_dtype)
    else:
        grads, new, model_state = _model_whole(state, batch, model, n, compute_dtype)
    new = micro.total(new, axis_name)
    if axis_name is not None:
        grads = micro.doubling_sum(grads, axis_name)
    return apply_gradients(state, metrics, grads, new, model_state, tx)


def eval_step(state: TrainState, metrics: dict, batch: dict, *, model: Model,
              axis_name: str | None, compute_dtype: str = "float32") -> dict:
    """step.eval_step on micro-batches, its sums in the fixed tree."""
    n = _per_device(axis_name)
    x, labels, mask = batch["image"], batch["label"], batch["mask"]
    if model.micro:
        logits, _ = apply_model(model, state.params, state.model_state, x, mask, compute_dtype,
                                train=False, axis_name=axis_name, micro=n)
        new = _each(example_metrics, n, logits, labels, mask)
    else:
        new = _each(lambda x, labels, mask: example_metrics(apply_model(
            model, state.params, state.model_state, x, mask, compute_dtype, train=False,
            axis_name=None)[0], labels, mask), n, x, labels, mask)
    return add_metrics(metrics, micro.total(new, axis_name))
