"""Micro-batches for the exact mode (jax_dp.exact): a layer run on each micro-batch alone, and
sums over micro-batches and devices in one balanced binary tree whatever the device count."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax


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


def total(stacked: Any, axis_name: str | None) -> Any:
    """The sum of per-micro-batch values (leading axis, this device's micro-batches in global
    order) over every micro-batch of every device: tree_sum, then doubling_sum."""
    summed = tree_sum(stacked)
    return summed if axis_name is None else doubling_sum(summed, axis_name)


def split(x: jax.Array, n: int) -> list[jax.Array]:
    """x's rows as n micro-batches, in order."""
    m = x.shape[0] // n
    return [x[i * m:(i + 1) * m] for i in range(n)]


def each(fn: Callable, *parts: list) -> Any:
    """fn of each micro-batch (parts: lists of micro-batches), stacked. Unrolled: XLA compiles a
    loop's body apart from straight-line code, and removes a loop of one, so with lax.map a
    device holding one micro-batch would compute it differently from one holding several."""
    outs = [fn(*part) for part in zip(*parts)]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


def apply(fn: Callable, *xs: Any) -> Any:
    """fn of xs, arrays; or, where they are lists of micro-batches, of each micro-batch alone.

    A model in the exact mode carries each activation as a list of micro-batches, so each
    micro-batch is the same subgraph of the program for any number of them: XLA fuses a
    slice of a larger array differently, and a fusion can change a kernel's bits."""
    return [fn(*part) for part in zip(*xs)] if isinstance(xs[0], list) else fn(*xs)


def part(x: Any) -> jax.Array:
    """x, or its first micro-batch where it is a list: for the sizes past the rows."""
    return x[0] if isinstance(x, list) else x


def layer(fn: Callable, x: Any, *weights: jax.Array) -> Any:
    """fn(x, *weights); where x is a list of micro-batches, fn of each, and the weights' gradient
    the tree_sum of the micro-batches' gradients.

    Differentiating a weight used n times, JAX adds its n cotangents one after another, in an
    order that follows n; here each micro-batch's gradient is kept apart and summed in the tree.
    """
    return list(_layer(fn, tuple(x), *weights)) if isinstance(x, list) else fn(x, *weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _layer(fn, parts, *weights):
    return _layer_fwd(fn, parts, *weights)[0]


def _layer_fwd(fn, parts, *weights):
    outs, pullbacks = zip(*(jax.vjp(fn, part, *weights) for part in parts))
    return tuple(outs), pullbacks  # A pullback is a pytree of its residuals.


def _layer_bwd(fn, pullbacks, cotangents):
    grads = [pullback(g) for pullback, g in zip(pullbacks, cotangents)]
    return (tuple(d[0] for d in grads),
            *tree_sum(jax.tree.map(lambda *ws: jnp.stack(ws), *[d[1:] for d in grads])))


_layer.defvjp(_layer_fwd, _layer_bwd)
