"""BatchNorm's training normalisation on micro-batches: every sum over rows taken per
micro-batch and added in the exact mode's tree, across devices by recursive doubling."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_dp.exact.micro import Parts, doubling_sum, total, tree_sum
from jax_dp.models import batch_norm


class BatchNorm(batch_norm.BatchNorm):
    """jax_dp.models.batch_norm.BatchNorm on Parts, its statistics summed in the tree."""

    def normalize(self, x, mask, scale, bias):
        return _normalize(x, mask, scale, bias, self.axis_name, self.epsilon)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _normalize(x: Parts, mask: Parts, scale, bias, axis_name, epsilon):
    return _normalize_fwd(x, mask, scale, bias, axis_name, epsilon)[0]


def _normalize_fwd(x, mask, scale, bias, axis_name, epsilon):
    m = x.map(batch_norm.broadcastable, mask)
    s1, s2, n = total(x.each(batch_norm.sums, m, mask), axis_name)
    mean = s1 / n
    raw_var = s2 / n - mean * mean
    var = jnp.maximum(raw_var, 0.0)
    inv = lax.rsqrt(var + epsilon)
    y = x.map(lambda x: (x - mean) * inv * scale + bias)
    return (y, mean, var, n), (x, m, mean, raw_var, inv, n, scale)


def _grads(dy, centred, inv):
    # inv inside the sum: a product as the last step of a term lets LLVM fuse it with the
    # tree's addition (an FMA) where XLA puts both in one loop, which depends on k.
    axes = tuple(range(dy.ndim - 1))
    return jnp.stack([jnp.sum(dy, axes), jnp.sum(dy * (centred * inv), axes)])


def _normalize_bwd(axis_name, epsilon, residuals, cotangents):
    x, m, mean, raw_var, inv, n, scale = residuals
    dy, dmean, dvar, _ = cotangents
    centred = x.map(lambda x: x - mean)
    # This device's parameter gradients (the train step sums them over devices once), and,
    # summed over every device, what the shared statistics get from all of them.
    per_micro = dy.each(_grads, centred, inv)
    dbias, dscale = tree_sum(per_micro)
    sum_dy, sum_dy_xhat = total(per_micro, axis_name)
    if axis_name is not None:
        dmean, dvar = doubling_sum(jnp.stack([dmean, dvar]), axis_name)
    dmean = dmean - inv * scale * sum_dy
    dvar = jnp.where(raw_var > 0, dvar - 0.5 * inv * inv * scale * sum_dy_xhat, 0.0)
    dx = dy.map(lambda dy, m, centred: dy * (inv * scale) + m * (dmean / n + centred * (2 * dvar / n)),
                m, centred)
    return dx, m.map(lambda m: 0 * m.reshape(-1)), dscale, dbias


_normalize.defvjp(_normalize_fwd, _normalize_bwd)
