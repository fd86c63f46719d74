"""A drop-in for lax.conv_general_dilated that keeps XLA:CPU's convolutions fast: each pass in
the formulation the measured table gives (jax_dp.xla_cpu.passes), gradients in canonical form."""

from __future__ import annotations

import functools
import itertools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jax_dp.xla_cpu import passes as passes_lib, resolve_grads

CANONICAL = ("NHWC", "HWIO", "NHWC")


def convolution(grads: str = "auto", platform: str = "cpu", passes=None) -> Callable:
    """The conv_general_dilated a model convolves with on platform: XLA's own where nothing
    was measured faster there, else conv with grads resolved and passes (the table, by
    default passes.json) read for platform."""
    grads = resolve_grads(grads, platform)
    passes = passes_lib.table() if passes is None else passes
    if grads == "xla" and not passes.get(platform):
        return lax.conv_general_dilated
    return functools.partial(conv_general_dilated, grads=grads,
                             choose=functools.partial(passes_lib.formulation, passes, platform))


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                         dimension_numbers=None, feature_group_count=1, precision=None, *,
                         grads="canonical", choose=lambda name, key: "conv"):
    """lax.conv_general_dilated for what models ask of it (canonical layout, no dilation, one
    group), through conv."""
    if (lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
            != lax.conv_dimension_numbers(lhs.shape, rhs.shape, CANONICAL)
            or any(d not in (None, 1) and set(d) != {1} for d in (lhs_dilation, rhs_dilation))
            or feature_group_count != 1 or precision is not None):
        raise ValueError("jax_dp.xla_cpu.conv supports NHWC/HWIO convolutions without dilation "
                         "or groups; pass conv_grads xla for others")
    return conv(lhs, rhs, window_strides, padding, grads, choose)


def conv(x: jax.Array, w: jax.Array, strides: Sequence[int] = (1, 1),
         padding: str | Sequence[tuple[int, int]] = "VALID", grads: str = "canonical",
         choose: Callable[[str, str], str] = lambda name, key: "conv") -> jax.Array:
    """NHWC images x HWIO kernel -> NHWC, as lax.conv_general_dilated, with the same values
    and gradients; only how the passes are written differs (grads: 'canonical' or 'xla').

    XLA:CPU runs a convolution on its fast kernels only in canonical form (NHWC input,
    HWIO kernel, NHWC output). JAX's own gradient convolutions are not canonical: XLA
    rewrites them in a step's entry computation but not inside a loop (lax.scan), where
    they fall back to a naive loop about 10x slower. Here both gradients are canonical
    forward convolutions:
      dx = g (dilated by the stride, padded k-1-p) conv the flipped kernel, in/out swapped;
      dw = x and g convolved over H and W, summing N, which needs one of them wholly
        transposed (N last): g, unless x is the smaller (_dw_from_g, _dw_from_x).
    choose(pass, layer key) names each pass's formulation (FORWARD, DX, DW; 'conv' is XLA's
    convolution): where the table names a layer, a pass may be a matrix product instead, the
    same values to rounding, measured faster on that platform.
    """
    strides = tuple(strides)
    pads = tuple(lax.padtype_to_pads(x.shape[1:3], w.shape[:2], strides, padding)
                 if isinstance(padding, str) else map(tuple, padding))
    key = passes_lib.layer_key(x.shape, w.shape, strides, pads)
    return _conv(x, w, strides, pads, grads, tuple(choose(name, key) for name in PASSES))


PASSES = ("forward", "dx", "dw")


def _plain(x, w, pads, lhs_dilation=(1, 1), rhs_dilation=(1, 1)):
    return lax.conv_general_dilated(x, w, (1, 1), pads, lhs_dilation, rhs_dilation,
                                    dimension_numbers=CANONICAL)


def _forward_conv(x, w, strides, pads):
    """The forward pass as XLA's convolution."""
    return lax.conv_general_dilated(x, w, strides, pads, dimension_numbers=CANONICAL)


def _shifted(x, kernel, strides, pads):
    """The padded input's kh·kw shifted, strided slices, one per tap (a, b), each
    (N, Ho, Wo, C)."""
    x = lax.pad(x, jnp.zeros((), x.dtype),
                [(0, 0, 0), *((lo, hi, 0) for lo, hi in pads), (0, 0, 0)])
    ho, wo = ((n - k) // s + 1 for n, k, s in zip(x.shape[1:3], kernel, strides))
    return [x[:, a:a + (ho - 1) * strides[0] + 1:strides[0],
              b:b + (wo - 1) * strides[1] + 1:strides[1]]
            for a, b in itertools.product(*map(range, kernel))]


def _windows(x, kernel, strides, pads):
    """Each output pixel's kh x kw x C input window as one row, (N, Ho, Wo, kh kw C)."""
    return jnp.concatenate(_shifted(x, kernel, strides, pads), -1)


def _forward_taps(x, w, strides, pads):
    """The forward pass as one matrix product: each output pixel's window against the kernel
    read as (kh kw C, O)."""
    kh, kw, c, o = w.shape
    return _windows(x, (kh, kw), strides, pads) @ w.reshape(kh * kw * c, o)


FORWARD = {"conv": _forward_conv, "taps": _forward_taps}  # passes.FORMULATIONS["forward"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _conv(x, w, strides, pads, grads, formulations):
    return FORWARD[formulations[0]](x, w, strides, pads)


def _conv_fwd(x, w, strides, pads, grads, formulations):
    return _conv(x, w, strides, pads, grads, formulations), (x, w)


def _conv_bwd(strides, pads, grads, formulations, residuals, g):
    x, w = residuals
    if grads == "xla":
        return jax.vjp(lambda x, w: lax.conv_general_dilated(
            x, w, strides, pads, dimension_numbers=CANONICAL), x, w)[1](g)
    sizes, kernel = x.shape[1:3], w.shape[:2]
    with jax.named_scope("conv_dx"):  # Names a profile's ops (experiments.measure.op_times).
        dx = DX[formulations[1]](g, w, sizes, strides, pads)
    with jax.named_scope("conv_dw"):
        dw = DW[formulations[2]](x, g, kernel, strides, pads)
    return dx.astype(x.dtype), dw.astype(w.dtype)


def _dx_conv(g, w, sizes, strides, pads):
    """dX as g (dilated by the stride, padded k-1-p) convolved with the flipped kernel."""
    # Rows the forward pass never reached (size + padding - k not a multiple of the stride)
    # get a zero gradient: the extra high padding below.
    dx_pads = [(k - 1 - lo, k - 1 - hi + (n + lo + hi - k) % s)
               for n, k, s, (lo, hi) in zip(sizes, w.shape[:2], strides, pads)]
    return _plain(g, jnp.flip(w, (0, 1)).swapaxes(2, 3), dx_pads, lhs_dilation=strides)


def _dx_taps(g, w, sizes, strides, pads):
    """dX as one matrix product, each output pixel's cotangent against the kernel read as
    (O, kh kw C), giving every tap's share at once; then each tap's share shifted to the input
    pixels it came from (a pad, negative where it crops; interior for a stride), all added in
    one fused pass."""
    kh, kw, c, o = w.shape
    n, ho, wo, _ = g.shape
    taps = (g.reshape(-1, o) @ w.reshape(kh * kw * c, o).T).reshape(n, ho, wo, kh, kw, c)
    dx = None
    for a, b in itertools.product(range(kh), range(kw)):
        placed = [(t - lo, size - (t - lo) - ((out - 1) * s + 1), s - 1)
                  for t, size, out, s, (lo, _) in zip((a, b), sizes, (ho, wo), strides, pads)]
        term = lax.pad(taps[:, :, :, a, b], jnp.zeros((), g.dtype),
                       [(0, 0, 0), *placed, (0, 0, 0)])
        dx = term if dx is None else dx + term
    return dx


DX = {"conv": _dx_conv, "taps": _dx_taps}  # passes.FORMULATIONS["dx"]


def _dw_conv(x, g, kernel, strides, pads):
    """dW as XLA's convolution of x and g, one of them transposed (_dw_from_x, _dw_from_g)."""
    # dW sums over N, so one of x and g must be wholly transposed (N last). XLA:CPU runs a
    # transpose at copy speed only when its input is in memory; fused with the BatchNorm and
    # ReLU it recomputes rather than read x, it is up to 10x slower. g comes from fusions
    # that XLA does not fuse further: transpose g, unless x is the smaller (a network's stem).
    dw_from = _dw_from_x if x[0].size < g[0].size else _dw_from_g
    return dw_from(x, g, kernel, strides, pads)


def _dw_taps(x, g, kernel, strides, pads):
    """dW as one matrix product: the input's windows (as the forward 'taps' builds them, which
    XLA computes once for both) read as (N Ho Wo, kh kw C), transposed, against g read as
    (N Ho Wo, O); no operand is transposed in memory."""
    rows = _windows(x, kernel, strides, pads)
    dw = rows.reshape(-1, rows.shape[-1]).T @ g.reshape(-1, g.shape[-1])
    return dw.reshape(*kernel, x.shape[3], g.shape[3])


DW = {"conv": _dw_conv, "taps": _dw_taps}  # passes.FORMULATIONS["dw"]


def _dw_from_x(x, g, kernel, strides, pads):
    """dW as x read as (C, H, W, N) conv g read as (Ho, Wo, N, O), dilated by the stride."""
    dw_pads = [(lo, k + (o - 1) * s - n - lo)
               for n, k, o, s, (lo, _) in zip(x.shape[1:3], kernel, g.shape[1:3], strides, pads)]
    dw = _plain(x.transpose(3, 1, 2, 0), g.transpose(1, 2, 0, 3), dw_pads, rhs_dilation=strides)
    return dw.transpose(1, 2, 0, 3)


def _dw_from_g(x, g, kernel, strides, pads):
    """dW as g read as (O, Ho, Wo, N) conv x[r::stride] read as (H, W, N, C), per phase r."""
    gt = g.transpose(3, 1, 2, 0)
    dw = jnp.zeros((*kernel, x.shape[3], g.shape[3]), jnp.result_type(x, g))
    axes = [_phases(*dims) for dims in zip(x.shape[1:3], kernel, g.shape[1:3], strides, pads)]
    for (rh, th, ph), (rw, tw, pw) in itertools.product(*axes):
        xt = x[:, rh::strides[0], rw::strides[1]].transpose(1, 2, 0, 3)
        taps = jnp.flip(_plain(gt, xt, (ph, pw)), (1, 2))  # It yields the taps last first.
        dw = dw.at[th.start::th.step, tw.start::tw.step].set(taps.transpose(1, 2, 3, 0))
    return dw


def _phases(size, k, out, s, pad):
    """Along one axis, per phase r of the stride: (r, the kernel taps t that meet x[r::s],
    g's padding that lines them up); tap t meets x[r::s][i + q] where t - lo = s * q + r."""
    lo, phases = pad[0], []
    for r in range(min(s, size)):
        taps = range((lo + r) % s, k, s)
        if taps:
            first, last = ((t - lo - r) // s for t in (taps[0], taps[-1]))
            phases.append((r, taps, (last, len(range(r, size, s)) - out - first)))
    return phases


_conv.defvjp(_conv_fwd, _conv_bwd)

