"""BatchNorm's training normalisation over a masked, possibly device-sharded batch, with its
gradient written out: two sums and one pass over the activations."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_dp import micro
from jax_dp.parallel import allreduce, same_varying


def normalize(x, mask, scale: jax.Array, bias: jax.Array, axis_name: str | None,
              epsilon: float) -> tuple:
    """(x - mean) / sqrt(var + epsilon) * scale + bias, and the mean and biased variance, both
    over the rows with mask 1 on every device of axis_name (None: this device's rows only).

    x and mask are arrays, or lists of micro-batches (the exact mode, jax_dp.micro): then
    every sum over rows is taken per micro-batch and added in the exact mode's tree.
    """
    if not isinstance(x, list):
        x, scale, bias = same_varying(x, scale, bias)
    return _normalize(x, mask, scale, bias, axis_name, epsilon)


def _sums(x, m, mask):
    """Per channel: the sum of x, of x^2 and the count, over the rows with mask 1."""
    axes = tuple(range(x.ndim - 1))
    rows = jnp.sum(mask) * (x.size // (x.shape[0] * x.shape[-1]))
    return jnp.stack([jnp.sum(x * m, axes), jnp.sum(x * x * m, axes),
                      jnp.broadcast_to(rows, x.shape[-1:])])


def _summed(per_rows, axis_name, *rows):
    """per_rows over every row of every device: one psum, or per micro-batch in the tree."""
    if isinstance(rows[0], list):
        return micro.total(micro.each(per_rows, *rows), axis_name)
    return allreduce(per_rows(*rows), axis_name)


def _statistics(x, mask, axis_name):
    m = micro.apply(lambda x, mask: mask.reshape((-1,) + (1,) * (x.ndim - 1)), x, mask)
    s1, s2, n = _summed(_sums, axis_name, x, m, mask)
    mean = s1 / n
    return m, mean, s2 / n - mean * mean, n


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _normalize(x, mask, scale, bias, axis_name, epsilon):
    return _normalize_fwd(x, mask, scale, bias, axis_name, epsilon)[0]


def _normalize_fwd(x, mask, scale, bias, axis_name, epsilon):
    m, mean, raw_var, n = _statistics(x, mask, axis_name)
    var = jnp.maximum(raw_var, 0.0)
    inv = lax.rsqrt(var + epsilon)
    y = micro.apply(lambda x: (x - mean) * inv * scale + bias, x)
    return (y, mean, var), (x, m, mean, raw_var, inv, n, scale)


def _normalize_bwd(axis_name, epsilon, residuals, cotangents):
    x, m, mean, raw_var, inv, n, scale = residuals
    dy, dmean, dvar = cotangents
    centred = micro.apply(lambda x: x - mean, x)

    def param_grads(dy, centred):
        axes = tuple(range(dy.ndim - 1))
        return jnp.stack([jnp.sum(dy, axes), jnp.sum(dy * centred, axes) * inv])

    def micro_grads(dy, centred):
        # inv inside the sum: a product as the last step of a term lets LLVM fuse it with the
        # tree's addition (an FMA) where XLA puts both in one loop, which depends on k.
        axes = tuple(range(dy.ndim - 1))
        return jnp.stack([jnp.sum(dy, axes), jnp.sum(dy * (centred * inv), axes)])

    # This device's parameter gradients (the train step sums them over devices once), and,
    # summed over every device, what the shared statistics get from all of them.
    if isinstance(x, list):  # Each sum per micro-batch, in the tree.
        per_micro = micro.each(micro_grads, dy, centred)
        dbias, dscale = micro.tree_sum(per_micro)
        sum_dy, sum_dy_xhat = micro.total(per_micro, axis_name)
        if axis_name is not None:
            dmean, dvar = micro.doubling_sum(jnp.stack([dmean, dvar]), axis_name)
    else:
        dbias, dscale = param_grads(dy, centred)
        sum_dy, sum_dy_xhat, dmean, dvar = allreduce(jnp.stack([dbias, dscale, dmean, dvar]),
                                                     axis_name)
    dmean = dmean - inv * scale * sum_dy
    dvar = jnp.where(raw_var > 0, dvar - 0.5 * inv * inv * scale * sum_dy_xhat, 0.0)
    dx = micro.apply(lambda dy, m, centred: dy * (inv * scale) + m * (dmean / n + centred * (2 * dvar / n)),
                     dy, m, centred)
    # The mask is data: no gradient (typed as it).
    return dx, micro.apply(lambda m: 0 * m.reshape(-1), m), dscale, dbias


_normalize.defvjp(_normalize_fwd, _normalize_bwd)
