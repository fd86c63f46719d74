"""BatchNorm's hand-written gradient equals JAX's derivative of the same formula."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dp.models.batch_norm import BatchNorm, normalize


def by_formula(x, mask, scale, bias, axis_name, epsilon):
    """The normalisation as plain JAX, which JAX differentiates itself (not in the mask: data)."""
    mask = jax.lax.stop_gradient(mask)
    m = mask.reshape((-1,) + (1,) * (x.ndim - 1))
    axes = tuple(range(x.ndim - 1))
    n = jnp.sum(mask) * (x.size // (x.shape[0] * x.shape[-1]))
    s1, s2 = jnp.sum(x * m, axes), jnp.sum(x * x * m, axes)
    if axis_name is not None:
        s1, s2, n = jax.lax.psum((s1, s2, n), axis_name)
    mean = s1 / n
    var = jnp.maximum(s2 / n - mean * mean, 0.0)
    return (x - mean) * jax.lax.rsqrt(var + epsilon) * scale + bias, mean, var


def inputs(shape, masked_rows, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(1.5, 2.0, shape)
    mask = np.ones(shape[0])
    mask[shape[0] - masked_rows:] = 0.0
    c = shape[-1]
    scale, bias = rng.normal(1.0, 0.3, c), rng.normal(0.0, 0.3, c)
    # Cotangents for all three outputs, the mean and variance's too.
    cots = rng.normal(size=shape), rng.normal(size=c), rng.normal(size=c)
    return (x, mask, scale, bias), cots


def vjp_of(fn, args, cots, axis_name=None):
    """fn's normalised rows, mean and variance, and their vjp (the count has no gradient)."""
    out, pullback = jax.vjp(lambda x, mask, s, b: fn(x, mask, s, b, axis_name, 1e-5)[:3], *args)
    return out, pullback(cots)


@pytest.mark.parametrize("shape,masked_rows", [((6, 5, 4, 3), 0), ((8, 3, 3, 5), 3),
                                               ((5, 2), 1)], ids=str)
def test_values_and_gradients_equal_the_formulas_on_one_device_in_float64(shape, masked_rows):
    with jax.enable_x64(True):
        args, cots = inputs(shape, masked_rows)
        want, got = (vjp_of(fn, args, cots) for fn in (by_formula, normalize))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12 * float(np.abs(b).max() or 1))


def test_padded_rows_get_no_gradient_from_the_statistics():
    """A padded row's x gets only its own output's gradient, never a share of the statistics'."""
    with jax.enable_x64(True):
        (x, mask, scale, bias), (dy, dmean, dvar) = inputs((6, 2, 2, 3), 2)
        dy[4:] = 0.0
        _, (dx, *_) = vjp_of(normalize, (x, mask, scale, bias), (dy, dmean, dvar))
    np.testing.assert_array_equal(dx[4:], 0.0)
    assert np.abs(dx[:4]).min() > 0


@pytest.mark.parametrize("k", [2, 4])
def test_k_devices_compute_the_one_device_gradients_in_float64(k):
    """Synchronised statistics: each device's dx is its rows of the one-device dx, and the
    parameter gradients summed over the devices are the one-device ones."""
    with jax.enable_x64(True):
        args, cots = inputs((8, 3, 3, 4), 3, seed=1)
        _, (dx, dmask, dscale, dbias) = vjp_of(normalize, args, cots)
        shard = lambda a: a.reshape((k, -1) + a.shape[1:])
        per_device = (shard(args[0]), shard(args[1]), args[2], args[3])
        dy, dmean, dvar = cots

        @functools.partial(jax.pmap, axis_name="d", in_axes=(0, 0, None, None, 0, None, None),
                           devices=jax.devices()[:k])
        def sharded(x, mask, s, b, dy, dmean, dvar):
            # Each device holds 1/k of the statistics' cotangent, as a loss summed over devices.
            return vjp_of(normalize, (x, mask, s, b), (dy, dmean / k, dvar / k), "d")

        out, (dx_k, _, dscale_k, dbias_k) = sharded(*per_device, shard(dy), dmean, dvar)
    np.testing.assert_allclose(dx_k.reshape(dx.shape), dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(dscale_k).sum(0), dscale, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(dbias_k).sum(0), dbias, rtol=1e-12)


def test_a_shard_of_padding_alone_gives_the_bias_and_no_gradient():
    """Per-device statistics over no real row (a device's shard of a partial batch): no 0/0,
    every row is the bias whatever the padding holds, and nothing flows back to x or scale
    (nor to the bias, from the masked loss's zero gradient on padded rows)."""
    (x, mask, scale, bias), cots = inputs((4, 2, 2, 3), 4)
    x[:] = 1e3
    local = functools.partial(normalize, local=True)
    (y, mean, var), (dx, _, dscale, dbias) = vjp_of(local, (x, mask, scale, bias), cots)
    np.testing.assert_array_equal(y, np.broadcast_to(bias, y.shape).astype(np.float32))
    for zero in (mean, var, dx, dscale):
        np.testing.assert_array_equal(zero, 0.0)
    np.testing.assert_allclose(dbias, cots[0].sum((0, 1, 2)), rtol=1e-6)
    assert local(x, mask, scale, bias, None, 1e-5)[3].tolist() == [0, 0, 0]


def test_running_statistics_stay_as_they_were_on_a_shard_of_padding_alone():
    """Catches an update that still mixes in the empty shard's statistics (exactly: the same
    bits, not 0.9 r + 0.1 r)."""
    x = jax.random.normal(jax.random.key(0), (4, 2, 2, 3)) * 5 + 2
    bn = BatchNorm(local=True)
    variables = bn.init(jax.random.key(1), x, jnp.ones(4), train=False)
    _, trained = bn.apply(variables, x, jnp.ones(4), train=True, mutable=["batch_stats"])
    y, kept = bn.apply({**variables, **trained}, x, jnp.zeros(4), train=True,
                       mutable=["batch_stats"])
    assert np.isfinite(y).all()
    chex.assert_trees_all_equal(kept, trained)
