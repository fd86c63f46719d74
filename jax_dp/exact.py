"""The exact mode: the same float32 bits on 1, 2, 4 or 8 devices.

A sum of floats depends on its order, and `lax.psum`'s order is unspecified. Here every sum
over examples is taken in one order that does not depend on the device count: the global batch
is cut into MICRO_BATCHES micro-batches of m examples (padding rows at fixed global positions),
each micro-batch's loss, counts and gradients are computed alone (every product on exactly m
examples, so XLA picks the same kernels for any k), and the per-micro-batch results are added
in one balanced binary tree in global micro-batch order: its lower levels on each device, its
upper levels across devices by recursive doubling. One device computes the same tree.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jax_dp.config import MICRO_BATCHES
from jax_dp.models.model import Model
from jax_dp.step import TrainState, add_metrics, apply_gradients, batch_metrics

def tree_sum(stacked: Any) -> Any:
    """Each leaf's sum over its leading axis (a power of two) as a balanced binary tree:
    neighbours first, then neighbouring pairs, and so on."""
    def pairwise(x):
        while x.shape[0] > 1:
            x = x[0::2] + x[1::2]
        return x[0]
    return jax.tree.map(pairwise, stacked)


def doubling_sum(tree: Any, axis_name: str) -> Any:
    """The sum over the devices by recursive doubling: at distance 1, 2, 4, ... each device adds
    its partner's partial sum. a + b and b + a are the same bits, so partners agree, and the
    levels continue tree_sum's tree over the devices' blocks of micro-batches."""
    k = lax.axis_size(axis_name)
    distance = 1
    while distance < k:
        partners = [(i, i ^ distance) for i in range(k)]
        tree = jax.tree.map(lambda x: x + lax.ppermute(x, axis_name, partners), tree)
        distance *= 2
    return tree


def micro_batches(batch: dict, n: int) -> dict:
    """This device's rows as [n, m, ...]: n micro-batches of m examples, in global order."""
    return jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)


def _per_device(axis_name: str | None) -> int:
    return MICRO_BATCHES // (1 if axis_name is None else lax.axis_size(axis_name))


def _each(fn, micro: dict) -> Any:
    """fn of each micro-batch, stacked. Unrolled: XLA compiles a loop's body apart from
    straight-line code, and removes a loop of one, so with lax.map a device holding one
    micro-batch would compute it differently from one holding several."""
    outs = [fn(jax.tree.map(lambda x: x[i], micro)) for i in range(jax.tree.leaves(micro)[0].shape[0])]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


def _summed(stacked: Any, axis_name: str | None) -> Any:
    total = tree_sum(stacked)
    return total if axis_name is None else doubling_sum(total, axis_name)


def train_step(state: TrainState, metrics: dict, batch: dict, *, model: Model,
               tx: optax.GradientTransformation, axis_name: str | None) -> tuple[TrainState, dict]:
    """step.train_step with every sum over examples in the fixed tree: for models without
    batch statistics (BatchNorm's are not yet exact)."""
    def one(micro):
        def loss_fn(params):
            logits, _ = model.apply(params, state.model_state, micro["image"], micro["mask"],
                                    train=True, axis_name=None)
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, micro["label"])
            return jnp.sum(losses * micro["mask"]), logits
        (loss_sum, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return grads, batch_metrics(logits, micro["label"], micro["mask"], loss_sum)

    grads, new = _summed(_each(one, micro_batches(batch, _per_device(axis_name))), axis_name)
    return apply_gradients(state, metrics, grads, new, state.model_state, tx)


def eval_step(state: TrainState, metrics: dict, batch: dict, *, model: Model,
              axis_name: str | None) -> dict:
    """step.eval_step on micro-batches, its sums in the fixed tree."""
    def one(micro):
        logits, _ = model.apply(state.params, state.model_state, micro["image"], micro["mask"],
                                train=False, axis_name=None)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, micro["label"])
        return batch_metrics(logits, micro["label"], micro["mask"], jnp.sum(losses * micro["mask"]))

    new = _summed(_each(one, micro_batches(batch, _per_device(axis_name))), axis_name)
    return add_metrics(metrics, new)
