"""The canonical convolution: lax.conv's values and gradients, in XLA:CPU's fast form everywhere."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jax_dp.xla_cpu import passes
from jax_dp.xla_cpu.conv import CANONICAL, DW, DX, FORWARD, _dw_from_g, _dw_from_x, conv, convolution

CASES = [  # (batch, size, channels in, channels out, kernel, stride, padding)
    (2, 9, 3, 4, 1, 1, "VALID"), (3, 8, 2, 5, 3, 1, "SAME"), (2, 11, 3, 4, 3, 2, "SAME"),
    (2, 10, 4, 3, 3, 2, ((1, 1), (1, 1))), (1, 13, 2, 3, 5, 1, "VALID"),
    (2, 12, 3, 2, 5, 2, ((2, 1), (0, 2))), (2, 7, 3, 3, 1, 2, "VALID"), (2, 9, 2, 4, 3, 2, "VALID"),
]
# Phases of the stride that meet no tap, or no row of x; even kernels; uneven padding.
MORE_CASES = [(2, 10, 2, 3, 3, 3, ((2, 0), (1, 2))), (2, 13, 2, 2, 4, 2, ((0, 3), (2, 1))),
              (2, 6, 1, 2, 2, 4, ((1, 1), (0, 0))), (1, 3, 2, 1, 5, 2, ((2, 2), (2, 2)))]


def reference_and_ours(case, dtype):
    n, size, c, o, k, s, padding = case
    rng = np.random.default_rng(sum(map(hash, map(str, case))) % 2**32)
    x = jnp.asarray(rng.normal(size=(n, size, size + 1, c)), dtype)
    w = jnp.asarray(rng.normal(size=(k, k, c, o)), dtype)
    plain = lambda x, w: lax.conv_general_dilated(x, w, (s, s), padding, dimension_numbers=CANONICAL)
    ours = lambda x, w: conv(x, w, (s, s), padding)
    results = []
    for f in (plain, ours):
        y, vjp = jax.vjp(f, x, w)
        g = jnp.asarray(np.random.default_rng(1).normal(size=y.shape), dtype)
        results.append((y, *vjp(g)))
    return results


@pytest.mark.parametrize("case", CASES + MORE_CASES, ids=str)
def test_value_and_both_gradients_equal_lax_conv_in_float64(case):
    with jax.enable_x64(True):
        want, got = reference_and_ours(case, jnp.float64)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12 * float(np.abs(b).max()))


@pytest.mark.parametrize("case", CASES[:4], ids=str)
def test_value_and_both_gradients_equal_lax_conv_in_float32(case):
    want, got = reference_and_ours(case, jnp.float32)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == jnp.float32
        # Sums of up to k*k*c*n products in another order: a few float32 ulps of their size.
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))


def float64_case(case, seed):
    """In float64 (call under jax.enable_x64): x, w, strides, pads, lax's output y, a random
    cotangent g, and lax's pullback of (x, w)."""
    n, size, c, o, k, s, padding = case
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n, size, size + 1, c)))
    w = jnp.asarray(rng.normal(size=(k, k, c, o)))
    y, pullback = jax.vjp(lambda x, w: lax.conv_general_dilated(
        x, w, (s, s), padding, dimension_numbers=CANONICAL), x, w)
    g = jnp.asarray(rng.normal(size=y.shape))
    pads = lax.padtype_to_pads(x.shape[1:3], (k, k), (s, s), padding) \
        if isinstance(padding, str) else padding
    return x, w, (s, s), pads, y, g, pullback


def assert_float64_equal(got, want):
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * float(np.abs(want).max()))


@pytest.mark.parametrize("dw_from", [_dw_from_x, _dw_from_g, DW["taps"]],
                         ids=["conv_from_x", "conv_from_g", "taps"])
@pytest.mark.parametrize("case", CASES + MORE_CASES, ids=str)
def test_each_weight_gradient_form_equals_lax_conv_in_float64(case, dw_from):
    """dW's convolution takes one of two forms per shape, and the pass table may pick the
    matrix product instead; each must hold for every shape."""
    with jax.enable_x64(True):
        x, w, strides, pads, _, g, pullback = float64_case(case, case[4] * case[5])
        assert_float64_equal(dw_from(x, g, w.shape[:2], strides, pads), pullback(g)[1])


@pytest.mark.parametrize("formulation", sorted(DX))
@pytest.mark.parametrize("case", CASES + MORE_CASES, ids=str)
def test_each_input_gradient_form_equals_lax_conv_in_float64(case, formulation):
    """The pass table picks a form of dX per layer; each must hold for every shape."""
    with jax.enable_x64(True):
        x, w, strides, pads, _, g, pullback = float64_case(case, case[4] * case[5] + 1)
        assert_float64_equal(DX[formulation](g, w, x.shape[1:3], strides, pads), pullback(g)[0])


@pytest.mark.parametrize("formulation", sorted(FORWARD))
@pytest.mark.parametrize("case", CASES + MORE_CASES, ids=str)
def test_each_forward_form_equals_lax_conv_in_float64(case, formulation):
    """The pass table picks a form of the forward pass per layer; each must hold everywhere."""
    with jax.enable_x64(True):
        x, w, strides, pads, y, _, _ = float64_case(case, case[4] * case[5] + 2)
        assert_float64_equal(FORWARD[formulation](x, w, strides, pads), y)


LAYER_A = (8, 13, 13, 20), (5, 5, 20, 50), (1, 1), ((0, 0), (0, 0))
LAYER_B = (8, 28, 28, 1), (3, 3, 1, 20), (1, 1), ((0, 0), (0, 0))


def dx_convolutions(convolve, layer) -> int:
    """Convolutions in the traced dX of convolve on a layer of these shapes (0: a matrix product)."""
    x_shape, w_shape, strides, pads = layer
    x, w = jnp.ones(x_shape), jnp.ones(w_shape)
    loss = lambda x: jnp.sum(convolve(x, w, strides, pads, dimension_numbers=CANONICAL))  # noqa: E731
    return jax.jit(jax.grad(loss)).lower(x).as_text().count("stablehlo.convolution")


def test_the_table_is_read_for_the_platform_and_the_layer_asked():
    """Catches a table entry that is ignored, applied to another layer, or on another platform:
    two platforms, each with an entry for one of two layers."""
    key_a, key_b = passes.layer_key(*LAYER_A), passes.layer_key(*LAYER_B)
    assert key_a == "13x13x20 5x5x20x50 s1x1 p0,0x0,0"
    table = {"cpu": {key_a: {"dx": "taps"}}, "gpu": {key_b: {"dx": "taps"}}}
    found = {(platform, key): passes.formulation(table, platform, "dx", key)
             for platform in ("cpu", "gpu", "tpu") for key in (key_a, key_b)}
    assert found == {("cpu", key_a): "taps", ("cpu", key_b): "conv", ("gpu", key_a): "conv",
                     ("gpu", key_b): "taps", ("tpu", key_a): "conv", ("tpu", key_b): "conv"}
    assert passes.formulation(table, "cpu", "dw", key_a) == "conv"
    # The same choices in the convolution a model is built with, traced.
    traced = {(platform, name): dx_convolutions(convolution("canonical", platform, table), layer)
              for platform in ("cpu", "gpu") for name, layer in (("a", LAYER_A), ("b", LAYER_B))}
    assert traced == {("cpu", "a"): 0, ("cpu", "b"): 1, ("gpu", "a"): 1, ("gpu", "b"): 0}


def test_a_platform_with_no_table_and_xlas_gradients_gets_lax_conv_itself():
    """Off CPU, 'auto' builds the model on XLA's own convolution, nothing of this package."""
    assert convolution("auto", "gpu", {"cpu": {"a": {"dx": "taps"}}}) is lax.conv_general_dilated
    assert convolution("auto", "cpu", {"cpu": {"a": {"dx": "taps"}}}) is not lax.conv_general_dilated


def test_the_shipped_table_is_data_that_names_known_formulations():
    """passes.json: platform -> layer key -> pass -> one of FORMULATIONS[pass]."""
    table = passes.table()
    assert table["cpu"]
    for layers in table.values():
        for key, chosen in layers.items():
            assert re.fullmatch(r"\d+x\d+x\d+ \d+x\d+x\d+x\d+ s\d+x\d+ p[\d,x]+", key), key
            assert chosen and all(f in passes.FORMULATIONS[name] for name, f in chosen.items())


@pytest.mark.parametrize("name, argnum", [("dx", 0), ("dw", 1)])
def test_the_chosen_formulation_is_the_one_traced(name, argnum):
    """The step's dX or dW for a layer in the table is a matrix product, not a convolution."""
    x, w = jnp.ones((4, 13, 13, 20)), jnp.ones((5, 5, 20, 50))

    def convs(table):
        convolve = convolution("canonical", "cpu", table)
        loss = lambda x, w: jnp.sum(convolve(x, w, (1, 1), "VALID",  # noqa: E731
                                             dimension_numbers=CANONICAL))
        return jax.jit(jax.grad(loss, argnum)).lower(x, w).as_text().count("stablehlo.convolution")

    assert convs({}) == 1  # The one gradient (the loss needs no forward value).
    key = passes.layer_key(x.shape, w.shape, (1, 1), ((0, 0), (0, 0)))
    assert convs({"cpu": {key: {name: "taps"}}}) == 0


def conv_layouts(fn, *args) -> list[str]:
    """dim_labels of every convolution in fn's optimized HLO (XLA:CPU's compiled program)."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return re.findall(r"convolution\(.*?dim_labels=([^,\s]+)", text)


def all_canonical(layouts):
    return bool(layouts) and all(label == "b01f_01io->b01f" for label in layouts)


def step_and_scan(model_name, batch_size, **options):
    """A model's single-device train step, and the same step under lax.scan over 3 batches."""
    import optax

    from jax_dp import assembly, step as step_lib

    model, tx = assembly.make_model(model_name, **options), optax.sgd(0.1)
    state = step_lib.init_state(model, tx, jax.random.key(0))
    step = lambda s, m, b: step_lib.train_step(s, m, b, model=model, tx=tx, axis_name=None)
    batch = {"image": jnp.zeros((batch_size, 28, 28, 1)), "label": jnp.zeros(batch_size, jnp.int32),
             "mask": jnp.ones(batch_size)}
    batches = jax.tree.map(lambda x: jnp.stack([x] * 3), batch)

    def scanned(state, metrics, batches):
        return jax.lax.scan(lambda carry, b: (step(*carry, b), None), (state, metrics), batches)[0]

    return ((step, state, step_lib.zero_metrics(), batch), (scanned, state, step_lib.zero_metrics(), batches))


@pytest.mark.parametrize("model,batch_size,options", [("lenet", 8, {"conv": "xla"}),
                                                      ("tests.tiny_resnet", 4, {})],
                         ids=["lenet", "resnet"])
def test_every_convolution_of_a_train_step_is_canonical_alone_and_in_a_scan(model, batch_size, options):
    """Catches a convolution or gradient convolution off XLA:CPU's fast path, which inside a
    loop runs about 10x slower: every one must be NHWC x HWIO -> NHWC."""
    for fn, *args in step_and_scan(model, batch_size, **options):
        layouts = conv_layouts(fn, *args)
        assert all_canonical(layouts), layouts


def test_the_guard_fails_for_plain_lax_conv_in_a_scan():
    """The check above can fail: lax.conv's own gradients are not canonical inside a loop."""
    w = jnp.ones((5, 5, 20, 50))

    def loss(w, x):
        return jnp.sum(lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=CANONICAL))

    def scanned(w, xs):
        return jax.lax.scan(lambda w, x: (w - jax.grad(loss)(w, x), None), w, xs)[0]

    layouts = conv_layouts(scanned, w, jnp.ones((3, 8, 12, 12, 20)))
    assert layouts and not all_canonical(layouts), layouts
    ours = lambda w, xs: jax.lax.scan(lambda w, x: (w - jax.grad(
        lambda w: jnp.sum(conv(x, w)))(w), None), w, xs)[0]
    assert all_canonical(conv_layouts(ours, w, jnp.ones((3, 8, 12, 12, 20))))


def test_gradients_are_canonical_on_cpu_and_xlas_own_elsewhere_unless_chosen():
    """Catches a CPU workaround applied on other platforms: 'auto' keeps XLA's own gradients
    off CPU; either can still be chosen, and both give the same values and gradients."""
    from jax_dp.xla_cpu import resolve_grads

    assert resolve_grads("auto", "cpu") == "canonical"
    assert resolve_grads("auto", "gpu") == resolve_grads("auto", "tpu") == "xla"
    assert resolve_grads("canonical", "gpu") == "canonical" and resolve_grads("xla", "cpu") == "xla"
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(4, 9, 9, 3)).astype(np.float32), rng.normal(size=(3, 3, 3, 5)).astype(np.float32)
    loss = lambda grads: lambda x, w: jnp.sum(conv(x, w, (2, 2), "SAME", grads=grads) ** 2)
    ours, xlas = (jax.value_and_grad(loss(g), (0, 1))(x, w) for g in ("canonical", "xla"))
    np.testing.assert_allclose(ours[0], xlas[0], rtol=1e-5)
    for a, b in zip(ours[1], xlas[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    # Inside a loop only the canonical gradients stay in XLA:CPU's fast form.
    def scanned(grads):
        body = lambda w, _: (w - 0.1 * jax.grad(loss(grads), 1)(x, w), None)
        return lambda w: jax.lax.scan(body, w, None, length=2)[0]
    assert all_canonical(conv_layouts(scanned("canonical"), w))
    assert not all_canonical(conv_layouts(scanned("xla"), w))
