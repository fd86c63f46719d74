"""One 2-D convolution for every model, kept in XLA:CPU's fast canonical form backward too."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

CANONICAL = ("NHWC", "HWIO", "NHWC")


def conv(x: jax.Array, w: jax.Array, strides: Sequence[int] = (1, 1),
         padding: str | Sequence[tuple[int, int]] = "VALID") -> jax.Array:
    """NHWC images x HWIO kernel -> NHWC, as lax.conv_general_dilated, with the same values
    and gradients; only how the gradients are written differs.

    XLA:CPU runs a convolution on its fast kernels only in canonical form (NHWC input,
    HWIO kernel, NHWC output). JAX's own gradient convolutions are not canonical: XLA
    rewrites them in a step's entry computation but not inside a loop (lax.scan), where
    they fall back to a naive loop about 10x slower. Here both gradients are canonical
    forward convolutions:
      dx = g (dilated by the stride, padded k-1-p) conv the flipped kernel, in/out swapped;
      dw = x read as (C, H, W, N) conv g read as (Ho, Wo, N, O), dilated by the stride.
    """
    strides = tuple(strides)
    # Under shard_map's type checks, give x and w one set of varying axes first, as JAX does
    # for its own primitives, so the custom gradients have the types of their inputs.
    varying = jax.typeof(x).mat.varying | jax.typeof(w).mat.varying
    x, w = (lax.pcast(a, tuple(varying - jax.typeof(a).mat.varying), to="varying")
            if varying - jax.typeof(a).mat.varying else a for a in (x, w))
    pads = tuple(lax.padtype_to_pads(x.shape[1:3], w.shape[:2], strides, padding)
                 if isinstance(padding, str) else map(tuple, padding))
    return _conv(x, w, strides, pads)


def _plain(x, w, pads, lhs_dilation=(1, 1), rhs_dilation=(1, 1)):
    return lax.conv_general_dilated(x, w, (1, 1), pads, lhs_dilation, rhs_dilation,
                                    dimension_numbers=CANONICAL)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _conv(x, w, strides, pads):
    return lax.conv_general_dilated(x, w, strides, pads, dimension_numbers=CANONICAL)


def _conv_fwd(x, w, strides, pads):
    return _conv(x, w, strides, pads), (x, w)


def _conv_bwd(strides, pads, residuals, g):
    x, w = residuals
    sizes, kernel, out = x.shape[1:3], w.shape[:2], g.shape[1:3]
    # Rows the forward pass never reached (size + padding - k not a multiple of the stride)
    # get a zero gradient: the extra high padding below.
    dx_pads = [(k - 1 - lo, k - 1 - hi + (n + lo + hi - k) % s)
               for n, k, s, (lo, hi) in zip(sizes, kernel, strides, pads)]
    with jax.named_scope("conv_dx"):  # Names a profile's ops (jax_dp.profile).
        dx = _plain(g, jnp.flip(w, (0, 1)).swapaxes(2, 3), dx_pads, lhs_dilation=strides)
    dw_pads = [(lo, k + (o - 1) * s - n - lo)
               for n, k, o, s, (lo, _) in zip(sizes, kernel, out, strides, pads)]
    with jax.named_scope("conv_dw"):
        dw = _plain(x.transpose(3, 1, 2, 0), g.transpose(1, 2, 0, 3), dw_pads, rhs_dilation=strides)
    return dx.astype(x.dtype), dw.transpose(1, 2, 0, 3).astype(w.dtype)


_conv.defvjp(_conv_fwd, _conv_bwd)


def flax_conv(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
              dimension_numbers=None, feature_group_count=1, precision=None):
    """conv in the signature flax.linen.Conv calls (its `conv_general_dilated=`), for the
    plain case it uses: NHWC x HWIO, no dilation, one feature group."""
    del dimension_numbers, precision  # Flax's are NHWC/HWIO; XLA:CPU's default precision.
    if any(d != 1 for d in (*(lhs_dilation or ()), *(rhs_dilation or ()))) or feature_group_count != 1:
        raise NotImplementedError("jax_dp's conv has no dilation and no feature groups")
    return conv(lhs, rhs, window_strides, padding)
