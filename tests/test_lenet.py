"""LeNet: exact size, shapes and initialisation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dp.models.lenet import init_lenet, lenet

from helpers import numpy_lenet, random_batches, run_steps


def test_parameter_count_is_exact():
    params = init_lenet(jax.random.key(0))
    # conv 3x3x1x20 + 20, conv 5x5x20x50 + 50, dense 800x128 + 128, dense 128x10 + 10.
    assert sum(p.size for p in jax.tree.leaves(params)) == 200 + 25_050 + 102_528 + 1_290


def test_output_is_ten_logits_per_image():
    params = init_lenet(jax.random.key(0))
    assert lenet(params, jnp.zeros((7, 28, 28, 1))).shape == (7, 10)


def test_init_is_the_books_normal_0_01_with_zero_biases():
    params = init_lenet(jax.random.key(0))
    w = np.asarray(params["fc1"]["w"])
    assert abs(w.std() - 0.01) < 2e-4 and abs(w.mean()) < 1e-4
    assert all(not np.asarray(layer["b"]).any() for layer in params.values())


def test_same_key_same_params_other_key_other_params():
    a, b, c = (init_lenet(jax.random.key(s)) for s in (0, 0, 1))
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert not np.array_equal(a["fc1"]["w"], c["fc1"]["w"])


@pytest.mark.parametrize("conv", ["xla", "im2col"])
def test_layers_compute_what_the_book_says(conv):
    """Catches any change to a layer (sizes, order, pooling, activation, flattening): the
    logits must equal a numpy LeNet's, written apart, for random nonzero weights."""
    from jax_dp.models.lenet import CONVS

    with jax.enable_x64(True):
        params = jax.tree.map(lambda p: p.astype(jnp.float64) + 0.05,
                              init_lenet(jax.random.key(0), scale=0.3))
        x = np.random.default_rng(0).normal(size=(3, 28, 28, 1))
        got = lenet(params, jnp.asarray(x), CONVS[conv])
        want = numpy_lenet(params, x)
    assert np.abs(want).max() > 1  # Logits far from zero: every layer contributes.
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def test_im2col_convolution_equals_lax_conv():
    from jax_dp.models.lenet import conv2d, conv2d_im2col

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.random((3, 13, 13, 20), np.float32))
    layer = {"w": jnp.asarray(rng.normal(size=(5, 5, 20, 50)).astype(np.float32)),
             "b": jnp.asarray(rng.normal(size=50).astype(np.float32))}
    # Sums of 500 products in another order: float32 round-off of ~sqrt(500) ulps of the terms.
    np.testing.assert_allclose(conv2d_im2col(x, layer), conv2d(x, layer), rtol=1e-5, atol=1e-4)


def test_the_fast_path_trains_to_the_readable_paths_params_after_20_steps():
    from jax_dp import assembly
    from experiments.measure import divergence

    batches = random_batches(20, 64)
    finals = [run_steps(assembly.make_model("lenet", conv=conv), "pmap", 2, batches, lr=0.2)[1].params
              for conv in ("xla", "im2col")]
    # The same bound as k devices against one (experiments.compare): re-associated sums.
    assert divergence.max_rel_diff(finals[1], finals[0]) <= 1e-6
