"""Micro-batches: a batch as its micro-batches, a layer run on each alone, and sums over
micro-batches and devices in one balanced binary tree whatever the device count."""

from __future__ import annotations

import functools
import operator
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


@jax.tree_util.register_pytree_node_class
class Parts:
    """A batch as its micro-batches, in order: arithmetic and `map` act on each alone.

    Each micro-batch is then the same subgraph of the program for any number of them: XLA
    fuses a slice of a larger array differently, and a fusion can change a kernel's bits.
    """

    def __init__(self, parts):
        self.parts = tuple(parts)

    @classmethod
    def split(cls, x: jax.Array, n: int) -> Parts:
        """x's rows as n micro-batches."""
        m = x.shape[0] // n
        return cls(x[i * m:(i + 1) * m] for i in range(n))

    def rows(self) -> jax.Array:
        """The micro-batches' rows as one array again."""
        return jnp.concatenate(self.parts)

    def map(self, fn: Callable, *others) -> Parts:
        """fn of each micro-batch (and of the same micro-batch of each Parts in others; any
        other value is passed whole to each)."""
        others = [o.parts if isinstance(o, Parts) else (o,) * len(self.parts) for o in others]
        return Parts(fn(*xs) for xs in zip(self.parts, *others))

    def each(self, fn: Callable, *others) -> Any:
        """map's results stacked along a new leading axis (one row per micro-batch)."""
        outs = self.map(fn, *others).parts
        return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)

    shape = property(lambda self: self.parts[0].shape)  # A micro-batch's: the sizes past the rows.
    dtype = property(lambda self: self.parts[0].dtype)
    ndim = property(lambda self: self.parts[0].ndim)
    __add__ = lambda self, other: self.map(operator.add, other)  # noqa: E731
    __sub__ = lambda self, other: self.map(operator.sub, other)  # noqa: E731
    __mul__ = lambda self, other: self.map(operator.mul, other)  # noqa: E731

    def astype(self, dtype) -> Parts:
        return self.map(lambda x: x.astype(dtype))

    def mean(self, axis) -> Parts:
        return self.map(lambda x: x.mean(axis=axis))

    def tree_flatten(self):
        return self.parts, None

    @classmethod
    def tree_unflatten(cls, _, parts):
        return cls(parts)


def layer(fn: Callable, x: Parts, *weights: jax.Array) -> Parts:
    """fn(part, *weights) of each micro-batch, the weights' gradient the tree_sum of the
    micro-batches' gradients.

    Differentiating a weight used n times, JAX adds its n cotangents one after another, in an
    order that follows n; here each micro-batch's gradient is kept apart and summed in the tree.
    """
    return Parts(_layer(fn, x.parts, *weights))


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
