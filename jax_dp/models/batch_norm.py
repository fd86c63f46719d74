"""BatchNorm's training normalisation over a masked, possibly device-sharded batch, with its
gradient written out: two sums and one pass over the activations."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_dp.parallel import allreduce, same_varying


def normalize(x: jax.Array, mask: jax.Array, scale: jax.Array, bias: jax.Array,
              axis_name: str | None, epsilon: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(x - mean) / sqrt(var + epsilon) * scale + bias, and the mean and biased variance, both
    over the rows with mask 1 on every device of axis_name (None: this device's rows only)."""
    x, scale, bias = same_varying(x, scale, bias)
    return _normalize(x, mask, scale, bias, axis_name, epsilon)


def _statistics(x, mask, axis_name):
    m = mask.reshape((-1,) + (1,) * (x.ndim - 1))
    axes = tuple(range(x.ndim - 1))
    rows = jnp.sum(mask) * (x.size // (x.shape[0] * x.shape[-1]))
    sums = jnp.stack([jnp.sum(x * m, axes), jnp.sum(x * x * m, axes),
                      jnp.broadcast_to(rows, x.shape[-1:])])
    s1, s2, n = allreduce(sums, axis_name)
    mean = s1 / n
    return m, mean, s2 / n - mean * mean, n


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _normalize(x, mask, scale, bias, axis_name, epsilon):
    return _normalize_fwd(x, mask, scale, bias, axis_name, epsilon)[0]


def _normalize_fwd(x, mask, scale, bias, axis_name, epsilon):
    m, mean, raw_var, n = _statistics(x, mask, axis_name)
    var = jnp.maximum(raw_var, 0.0)
    inv = lax.rsqrt(var + epsilon)
    y = (x - mean) * inv * scale + bias
    return (y, mean, var), (x, m, mean, raw_var, inv, n, scale)


def _normalize_bwd(axis_name, epsilon, residuals, cotangents):
    x, m, mean, raw_var, inv, n, scale = residuals
    dy, dmean, dvar = cotangents
    centred = x - mean
    axes = tuple(range(x.ndim - 1))
    # This device's parameter gradients (the train step sums them over devices once)...
    dbias, dscale = jnp.sum(dy, axes), jnp.sum(dy * centred, axes) * inv
    # ...and, summed over every device, what the shared statistics get from all of them.
    sum_dy, sum_dy_xhat, dmean, dvar = allreduce(jnp.stack([dbias, dscale, dmean, dvar]),
                                                 axis_name)
    dmean = dmean - inv * scale * sum_dy
    dvar = jnp.where(raw_var > 0, dvar - 0.5 * inv * inv * scale * sum_dy_xhat, 0.0)
    dx = dy * (inv * scale) + m * (dmean / n + centred * (2 * dvar / n))
    return dx, 0 * m.reshape(-1), dscale, dbias  # The mask is data: no gradient (typed as it).


_normalize.defvjp(_normalize_fwd, _normalize_bwd)
