"""ResNet-18: exact size; k devices with synchronised BatchNorm train exactly like one."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.measure import divergence
from jax_dp import assembly, data, models, step as step_lib, train
from jax_dp.devices import get_devices
from jax_dp.models.resnet import BatchNorm

from helpers import random_batches, run_steps

RESNET = assembly.make_model("resnet18")
# ResNet-18's code narrowed (tests/tiny_resnet.py), for the multi-step and multi-device checks
# where the width adds compile time, not a path: the same blocks and synchronised BatchNorm.
TINY = assembly.make_model("tests.tiny_resnet")


def residual_params(c_in, c, shortcut):
    """Two 3x3 convolutions, each with BatchNorm (scale, bias), maybe a 1x1 shortcut with bias."""
    return 9 * c_in * c + 2 * c + 9 * c * c + 2 * c + (c_in * c + c if shortcut else 0)


def test_parameter_count_is_exact():
    params, stats = jax.eval_shape(RESNET.init, jax.random.key(0))  # Shapes alone: no compile.
    stem = 9 * 1 * 64 + 2 * 64
    stages = 2 * residual_params(64, 64, False)
    for c_in, c in ((64, 128), (128, 256), (256, 512)):
        stages += residual_params(c_in, c, True) + residual_params(c, c, False)
    assert sum(p.size for p in jax.tree.leaves(params)) == stem + stages + 512 * 10 + 10 == 11_171_914
    bn_channels = 64 + 4 * (64 + 128 + 256 + 512)
    assert sum(s.size for s in jax.tree.leaves(stats)) == 2 * bn_channels


def test_output_shape_and_resolution_schedule():
    params, stats = jax.eval_shape(RESNET.init, jax.random.key(0))  # Shapes alone: no compile.
    x = jnp.zeros((3, 28, 28, 1))
    logits, _ = jax.eval_shape(lambda p, s: RESNET.apply(p, s, x, jnp.ones(3), train=False,
                                                         axis_name=None), params, stats)
    assert logits.shape == (3, 10)
    conv_out = jax.eval_shape(lambda p, s: models.resnet.ResNet().apply(
        {"params": p, "batch_stats": s}, x, jnp.ones(3), train=False,
        capture_intermediates=True, mutable=["intermediates"]), params, stats)[1]["intermediates"]
    # Stride 1 stem, no max-pool: 28x28 until stage 2 halves it, then 7x7 and 4x4.
    assert conv_out["Residual_1"]["__call__"][0].shape == (3, 28, 28, 64)
    assert conv_out["Residual_7"]["__call__"][0].shape == (3, 4, 4, 512)


def test_batchnorm_training_normalises_with_masked_batch_statistics():
    x = jax.random.normal(jax.random.key(0), (6, 2, 2, 3)) * 5 + 2
    mask = jnp.array([1, 1, 1, 1, 0, 0], jnp.float32)
    bn = BatchNorm(momentum=0.5)
    variables = bn.init(jax.random.key(1), x, mask, train=False)
    y, updates = bn.apply(variables, x, mask, train=True, mutable=["batch_stats"])
    real = np.asarray(x[:4]).reshape(-1, 3)
    np.testing.assert_allclose(np.asarray(y[:4]).reshape(-1, 3).mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(y[:4]).reshape(-1, 3).var(0), 1, rtol=1e-3)
    np.testing.assert_allclose(updates["batch_stats"]["mean"], 0.5 * real.mean(0), rtol=1e-5)
    np.testing.assert_allclose(updates["batch_stats"]["var"], 0.5 + 0.5 * real.var(0), rtol=1e-4)


def test_batchnorm_defaults_are_momentum_0_9_epsilon_1e_5_and_the_biased_variance():
    """Catches a change of momentum, epsilon or the variance's divisor (n, not n - 1):
    checked by hand in float64 on a batch whose variance is near epsilon, so each shows."""
    with jax.enable_x64(True):
        x = np.random.default_rng(0).normal(size=(5, 3, 2, 4)) * 3e-3 + 0.5
        mask = np.ones(5)
        bn = BatchNorm()
        variables = bn.init(jax.random.key(0), jnp.asarray(x), jnp.asarray(mask), train=False)
        y, updates = bn.apply(variables, jnp.asarray(x), jnp.asarray(mask), train=True,
                              mutable=["batch_stats"])
        stats = updates["batch_stats"]
        y_eval = bn.apply({**variables, "batch_stats": stats}, jnp.asarray(x), jnp.asarray(mask),
                          train=False)
    rows = x.reshape(-1, 4)
    mean, var = rows.mean(0), ((rows - rows.mean(0)) ** 2).sum(0) / len(rows)
    np.testing.assert_allclose(y, (x - mean) / np.sqrt(var + 1e-5), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(stats["mean"], 0.9 * 0 + 0.1 * mean, rtol=1e-12)
    np.testing.assert_allclose(stats["var"], 0.9 * 1 + 0.1 * var, rtol=1e-12)
    np.testing.assert_allclose(y_eval, (x - 0.1 * mean) / np.sqrt(0.9 + 0.1 * var + 1e-5),
                               rtol=1e-10)


def test_resnet18_uses_those_defaults_in_its_stem():
    """Catches the model overriding BatchNorm's defaults: the stem's running statistics after
    one training pass, against a hand computation from the stem convolution's output (ResNet-18's
    code, narrow: its width changes no BatchNorm setting)."""
    variables = jax.jit(TINY.init)(jax.random.key(0))  # One program, not an op at a time.
    with jax.enable_x64(True):
        params, state = divergence.cast(variables, jnp.float64)
        x = jnp.asarray(np.random.default_rng(1).random((4, 28, 28, 1)))
        apply = jax.jit(functools.partial(TINY.apply, train=True, axis_name=None))
        _, new_state = apply(params, state, x, jnp.ones(4))
        stem = jax.lax.conv_general_dilated(x, params["Conv_0"]["kernel"], (1, 1), ((1, 1), (1, 1)),
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))
    rows = np.asarray(stem).reshape(-1, stem.shape[-1])
    np.testing.assert_allclose(new_state["BatchNorm_0"]["mean"], 0.1 * rows.mean(0), rtol=1e-9)
    np.testing.assert_allclose(new_state["BatchNorm_0"]["var"], 0.9 + 0.1 * rows.var(0), rtol=1e-9)


def assert_each_leaf_close(tree, reference, rel):
    """Every leaf's max |difference| is at most rel times that leaf's max |value|."""
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(reference)):
        assert divergence.max_rel_diff(a, b) <= rel


def test_one_step_with_synced_batchnorm_on_4_devices_equals_one_device(k=4):
    batches = random_batches(1, 8, size=8)
    _, reference, m1 = run_steps(TINY, "single", 1, batches, lr=0.1)
    state, pmapped, mk = run_steps(TINY, "pmap", k, batches, lr=0.1)
    # float32 round-off only (sums over 8 x 8 x 8 = 512 values per channel, split k ways),
    # which the near-cancelling gradients of BatchNorm biases magnify: 7e-7 and 2e-7 here;
    # statistics kept per device (bn="local") are off by 1.3 and 0.18.
    assert_each_leaf_close(pmapped.params, reference.params, 1e-5)
    assert_each_leaf_close(pmapped.model_state, reference.model_state, 1e-6)
    np.testing.assert_allclose(mk["loss_sum"], m1["loss_sum"], rtol=1e-6)
    for leaf in jax.tree.leaves(state.model_state):  # Running statistics agree on every replica.
        replicas = np.asarray(leaf)
        assert all(np.array_equal(replicas[0], r) for r in replicas[1:])


@pytest.fixture(scope="module")
def float64_reference():
    """Three single-device steps of the narrow ResNet in float64, and their batches."""
    with jax.enable_x64(True):
        batches = random_batches(3, 8, size=8, dtype=np.float64)
        return batches, run_steps(TINY, "single", 1, batches, lr=0.1, dtype=jnp.float64)[1]


@pytest.mark.parametrize("k", [2, 4])
def test_several_steps_with_synced_batchnorm_equal_one_device_in_float64(float64_reference, k):
    # Over several steps, SGD on 8 examples magnifies float32 round-off ~1e5-fold (a 1e-7
    # nudge of the initial params moves some BatchNorm biases by 1% after one step), so the
    # exact equivalence is checked in float64: round-off 1e-16, times that, is ~1e-11.
    batches, reference = float64_reference
    with jax.enable_x64(True):
        _, pmapped, _ = run_steps(TINY, "pmap", k, batches, lr=0.1, dtype=jnp.float64)
    assert jax.tree.leaves(reference.params)[0].dtype == np.float64
    assert_each_leaf_close(pmapped.params, reference.params, 1e-8)
    assert_each_leaf_close(pmapped.model_state, reference.model_state, 1e-8)


def test_local_batchnorm_statistics_differ_between_replicas():
    local = assembly.make_model("tests.tiny_resnet", bn="local")
    state, _, _ = run_steps(local, "pmap", 2, random_batches(1, 8, size=8), lr=0.1)
    means = np.asarray(state.model_state["BatchNorm_0"]["mean"])
    assert not np.allclose(means[0], means[1])


def test_evaluation_is_deterministic_and_counts_every_example():
    tx = optax.sgd(0.1)
    program = assembly.build(TINY, tx, "pmap", get_devices(4))
    state = program.backend.replicate(step_lib.init_state(TINY, tx, jax.random.key(0)))
    rng = np.random.default_rng(0)
    split = data.Split(rng.random((13, 8, 8, 1), np.float32), rng.integers(0, 10, 13).astype(np.int32))
    first, second = (train.evaluate(program, state, split, batch_size=6) for _ in range(2))
    assert first == second and first["count"] == 13


def test_unknown_bn_mode_is_refused():
    with pytest.raises(ValueError, match="unknown bn 'global'"):
        assembly.make_model("resnet18", bn="global")


def torch_resnet_like(params, stage_channels, blocks_per_stage):
    """experiments.measure.torch_peer's ResNet-18 (independent code) holding jax_dp's params
    (by layer path, as 'Residual_0/Conv_1'), in float64; and each PyTorch param by its jax_dp
    twin's path ('Residual_0/Conv_1/kernel')."""
    import torch

    from experiments.measure import torch_peer

    net = torch_peer.resnet18(stage_channels, blocks_per_stage).double()
    twins = {}

    def put(module, path, kind):
        leaves = {"conv": {"weight": ("kernel", (3, 2, 0, 1)), "bias": ("bias", None)},
                  "bn": {"weight": ("scale", None), "bias": ("bias", None)},
                  "dense": {"weight": ("kernel", (1, 0)), "bias": ("bias", None)}}[kind]
        for name, (leaf, order) in leaves.items():
            if getattr(module, name, None) is None:
                continue
            value = torch.tensor(np.asarray(params[path][leaf], np.float64))
            getattr(module, name).data.copy_(value.permute(*order) if order else value)
            twins[f"{path}/{leaf}"] = getattr(module, name)

    put(net[0], "Conv_0", "conv")
    put(net[1], "BatchNorm_0", "bn")
    blocks = [m for m in net if isinstance(m, torch_peer.Residual)]
    for i, block in enumerate(blocks):
        for module, name, kind in ((block.conv1, "Conv_0", "conv"), (block.conv2, "Conv_1", "conv"),
                                   (block.conv3, "Conv_2", "conv"), (block.bn1, "BatchNorm_0", "bn"),
                                   (block.bn2, "BatchNorm_1", "bn")):
            if module is not None:
                put(module, f"Residual_{i}/{name}", kind)
    put(net[-1], "Dense_0", "dense")
    return net, twins


def test_the_resnet_and_its_gradients_equal_an_independent_pytorch_resnet_in_float64():
    """Catches a block that drops its shortcut, a layer out of place or a wrong stride: one
    training step's logits and every gradient against experiments.measure.torch_peer's
    ResNet-18 (same code path as ResNet-18, narrow: tests/tiny_resnet.py), same weights."""
    import torch

    rng = np.random.default_rng(0)
    params, state = jax.jit(TINY.init)(jax.random.key(0))
    # Weights far from the init's near-zero scale, BatchNorm's scale and bias not 1 and 0: each
    # layer then shows in the logits.
    params = jax.tree.map(lambda a: np.asarray(a) + rng.normal(0, 0.3, a.shape), params)
    x, y = rng.random((6, 28, 28, 1)), rng.integers(0, 10, 6)
    with jax.enable_x64(True):
        params64, state64 = divergence.cast((params, state), jnp.float64)

        def loss(p):
            logits, _ = TINY.apply(p, state64, jnp.asarray(x), jnp.ones(6), train=True,
                                   axis_name=None)
            return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(y)).mean(), logits
        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params64)
    flat = {"/".join(k.key for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(params64)[0]}
    layered = {}
    for key, leaf in flat.items():
        layer, name = key.rsplit("/", 1)
        layered.setdefault(layer, {})[name] = leaf
    net, twins = torch_resnet_like(layered, (8, 16), 1)
    net.train()
    out = net(torch.tensor(x).permute(0, 3, 1, 2))
    torch.nn.functional.cross_entropy(out, torch.tensor(y)).backward()
    np.testing.assert_allclose(out.detach().numpy(), logits, rtol=1e-9, atol=1e-9)
    got = {"/".join(k.key for k in path): leaf
           for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]}
    assert set(twins) == set(got)
    for key, param in twins.items():
        want = param.grad.numpy()
        order = (3, 2, 0, 1) if key.endswith("kernel") and want.ndim == 4 else \
            (1, 0) if key.endswith("kernel") else None
        mine = np.transpose(np.asarray(got[key]), order) if order else np.asarray(got[key])
        np.testing.assert_allclose(mine, want, rtol=1e-7, atol=1e-9 * np.abs(want).max(), err_msg=key)
