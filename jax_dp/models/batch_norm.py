"""BatchNorm synchronised over devices: its training statistics are the global batch's, taken
over the real rows only, with the normalisation's gradient written out (two sums, one pass)."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jax_dp.parallel import allreduce


class BatchNorm(nn.Module):
    """BatchNorm whose training statistics cover the real rows of the whole global batch.

    In training, per-channel sums of x and x^2 over the rows with mask 1 are summed over
    `axis_name` (one all-reduce), so k devices normalise with the very statistics one
    device would compute on the global batch, and padded rows are ignored. With
    axis_name None each device uses its own shard's statistics (the book's behaviour); `local`
    says the shard may hold no real row (per-device statistics of a partial batch): its rows
    then all come out as the bias, with no gradient, and the running statistics stay.
    Running averages: r <- momentum * r + (1 - momentum) * batch statistic.
    """
    axis_name: str | None = None
    momentum: float = 0.9
    epsilon: float = 1e-5
    local: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array, train: bool) -> jax.Array:
        features = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (features,))
        bias = self.param("bias", nn.initializers.zeros, (features,))
        running_mean = self.variable("batch_stats", "mean", jnp.zeros, (features,))
        running_var = self.variable("batch_stats", "var", jnp.ones, (features,))
        dtype = x.dtype  # Statistics in float32 at least, the output in x's dtype.
        x = x.astype(jnp.promote_types(dtype, jnp.float32))
        if not train:
            return ((x - running_mean.value) * lax.rsqrt(running_var.value + self.epsilon)
                    * scale + bias).astype(dtype)
        y, mean, var, n = self.normalize(x, mask, scale.astype(x.dtype), bias.astype(x.dtype))
        if not self.is_initializing():
            # Statistics of no real row (a device's shard of padding alone, under per-device
            # statistics) leave the running ones as they were.
            for running, stat in ((running_mean, mean), (running_var, var)):
                running.value = jnp.where(
                    n > 0, self.momentum * running.value + (1 - self.momentum) * stat, running.value)
        return y.astype(dtype)

    def normalize(self, x, mask, scale, bias):
        """The normalised batch, its mean and variance, and the count of rows they are over."""
        return normalize(x, mask, scale, bias, self.axis_name, self.epsilon, self.local)


def normalize(x: jax.Array, mask: jax.Array, scale: jax.Array, bias: jax.Array,
              axis_name: str | None, epsilon: float, local: bool = False) -> tuple:
    """(x - mean) / sqrt(var + epsilon) * scale + bias, the mean and biased variance, and the
    count of rows they are over: those with mask 1 on every device of axis_name (None: this
    device's rows only). local: there may be no such row; every row is then `bias`, with no
    gradient, and the mean and variance 0."""
    return _normalize(x, mask, scale, bias, axis_name, epsilon, local)


def sums(x, m, mask):
    """Per channel: the sum of x, of x^2 and the count, over the rows with mask 1 (m: the mask
    shaped to broadcast against x)."""
    axes = tuple(range(x.ndim - 1))
    rows = jnp.sum(mask) * (x.size // (x.shape[0] * x.shape[-1]))
    return jnp.stack([jnp.sum(x * m, axes), jnp.sum(x * x * m, axes),
                      jnp.broadcast_to(rows, x.shape[-1:])])


def broadcastable(x, mask):
    """mask shaped [B, 1, ..., 1] to multiply x's rows."""
    return mask.reshape((-1,) + (1,) * (x.ndim - 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _normalize(x, mask, scale, bias, axis_name, epsilon, local):
    return _normalize_fwd(x, mask, scale, bias, axis_name, epsilon, local)[0]


def _normalize_fwd(x, mask, scale, bias, axis_name, epsilon, local):
    m = broadcastable(x, mask)
    s1, s2, count = allreduce(sums(x, m, mask), axis_name)
    # Synchronised statistics cover the global batch, which always holds a real row; only a
    # local shard can hold none. No 0/0 then: every sum is 0, and so is inv below. (Kept out
    # of the synchronised path, where it would change how XLA fuses the line that computes y.)
    n = jnp.maximum(count, 1) if local else count
    mean = s1 / n
    raw_var = s2 / n - mean * mean
    var = jnp.maximum(raw_var, 0.0)
    inv = lax.rsqrt(var + epsilon)
    if local:
        inv = jnp.where(count > 0, inv, 0.0)
    y = (x - mean) * inv * scale + bias
    return (y, mean, var, count), (x, m, mean, raw_var, inv, n, scale)


def _normalize_bwd(axis_name, epsilon, local, residuals, cotangents):
    x, m, mean, raw_var, inv, n, scale = residuals
    dy, dmean, dvar, _ = cotangents
    centred = x - mean
    axes = tuple(range(dy.ndim - 1))
    # This device's parameter gradients (the train step sums them over devices once), and,
    # summed over every device, what the shared statistics get from all of them.
    dbias, dscale = jnp.sum(dy, axes), jnp.sum(dy * centred, axes) * inv
    sum_dy, sum_dy_xhat, dmean, dvar = allreduce(jnp.stack([dbias, dscale, dmean, dvar]),
                                                 axis_name)
    dmean = dmean - inv * scale * sum_dy
    dvar = jnp.where(raw_var > 0, dvar - 0.5 * inv * inv * scale * sum_dy_xhat, 0.0)
    dx = dy * (inv * scale) + m * (dmean / n + centred * (2 * dvar / n))
    return dx, 0 * m.reshape(-1), dscale, dbias  # The mask is data: no gradient.


_normalize.defvjp(_normalize_fwd, _normalize_bwd)
