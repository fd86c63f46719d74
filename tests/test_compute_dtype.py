"""--compute-dtype bfloat16: the model computes in bfloat16; params, gradient sums and updates
stay float32; its losses stay near float32's, and k devices near one."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax_dp import assembly, data, step as step_lib
from jax_dp.config import TrainConfig
from jax_dp.devices import get_devices
from jax_dp.errors import ParamError
from jax_dp.models.model import Model
from jax_dp.models.precision import computing_in

sys.path.insert(0, "tests")
import tiny_resnet  # noqa: E402

MODELS = {"lenet": assembly.make_model("lenet"), "tiny_resnet": tiny_resnet.make()}


@pytest.fixture(scope="module")
def batches(fashion_train_6k):
    split = data.Split(fashion_train_6k.images[:10 * 64], fashion_train_6k.labels[:10 * 64])
    return list(data.batches(split, 64))


def run(model, batches, k, compute_dtype):
    """10 SGD steps with momentum: the state and the mean loss over the steps."""
    tx = optax.sgd(0.1, momentum=0.9)
    program = assembly.build(computing_in(model, compute_dtype), tx, "pmap", get_devices(k))
    b = program.backend
    state, metrics = b.replicate(step_lib.init_state(model, tx, jax.random.key(0))), \
        b.replicate(step_lib.zero_metrics())
    for batch in batches:
        state, metrics = program.train(state, metrics, b.shard(batch))
    metrics = b.unreplicate(metrics)
    return b.unreplicate(state), float(metrics["loss_sum"] / metrics["count"])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bfloat16_trains_near_float32_and_keeps_float32_params(batches, name):
    """Catches a cast that leaks into the params or optimizer state, and a flag that changes
    nothing (the losses must differ from float32's, by little)."""
    state32, loss32 = run(MODELS[name], batches, 1, "float32")
    state16, loss16 = run(MODELS[name], batches, 1, "bfloat16")
    assert {leaf.dtype for leaf in jax.tree.leaves(state16)} == {np.dtype(np.float32)}
    assert loss16 != loss32 and abs(loss16 - loss32) < 0.01 * loss32
    k2_state, k2_loss = run(MODELS[name], batches, 2, "bfloat16")
    assert abs(k2_loss - loss16) < 0.01 * loss16


def test_the_model_computes_in_bfloat16_and_the_loss_in_float32():
    """What the model is given and returns, recorded while the step is traced."""
    seen = []
    lenet = MODELS["lenet"]

    def apply(params, state, x, mask, **kwargs):
        seen.append((x.dtype, {leaf.dtype for leaf in jax.tree.leaves(params)}))
        logits, state = lenet.apply(params, state, x, mask, **kwargs)
        seen.append(logits.dtype)
        return logits, state

    model = Model(lenet.init, apply)
    tx = optax.sgd(0.1)
    step = jax.jit(lambda s, m, b: step_lib.train_step(s, m, b, model=computing_in(model, "bfloat16"),
                                                       tx=tx, axis_name=None))
    batch = {"image": jnp.zeros((8, 28, 28, 1)), "label": jnp.zeros(8, jnp.int32), "mask": jnp.ones(8)}
    state, metrics = step(step_lib.init_state(model, tx, jax.random.key(0)), step_lib.zero_metrics(), batch)
    assert seen == [(jnp.bfloat16, {jnp.dtype(jnp.bfloat16)}), jnp.bfloat16]
    assert metrics["loss_sum"].dtype == jnp.float32


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_are_summed_over_devices_in_float32(name):
    """Catches a gradient all-reduce in bfloat16: every all-reduce of the step is float32."""
    model, tx = MODELS[name], optax.sgd(0.1)
    program = assembly.build(computing_in(model, "bfloat16"), tx, "shard_map", get_devices(2))
    b = program.backend
    state = b.replicate(step_lib.init_state(model, tx, jax.random.key(0)))
    batch = b.shard({"image": np.zeros((8, 28, 28, 1), np.float32), "label": np.zeros(8, np.int32),
                     "mask": np.ones(8, np.float32)})
    hlo = program.lower("train", state, b.replicate(step_lib.zero_metrics()), batch).as_text()
    reduces = [line for line in hlo.splitlines() if "all_reduce" in line or "all-reduce" in line]
    assert reduces and not any("bf16" in line for line in reduces)


def test_the_exact_mode_with_bfloat16_is_refused():
    with pytest.raises(ParamError, match="exact gives float32's bits; with compute_dtype bfloat16"):
        TrainConfig(exact=True, compute_dtype="bfloat16")


def test_an_unknown_compute_dtype_is_refused():
    with pytest.raises(ParamError, match="float16"):
        TrainConfig(compute_dtype="float16")


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_the_cross_entropy_takes_float32_logits(compute_dtype, monkeypatch):
    """Catches bfloat16 logits reaching the loss (the mask's float32 would still make the sum
    float32): the dtype the loss sees, recorded while the step is traced."""
    seen = []
    loss = optax.softmax_cross_entropy_with_integer_labels
    monkeypatch.setattr(step_lib.optax, "softmax_cross_entropy_with_integer_labels",
                        lambda logits, labels: seen.append(logits.dtype) or loss(logits, labels))
    model, tx = MODELS["lenet"], optax.sgd(0.1)
    step = step_lib.make_steps(computing_in(model, compute_dtype), tx, None).train_step
    state = step_lib.init_state(model, tx, jax.random.key(0))
    batch = data.zero_batch(4)
    jax.make_jaxpr(step)(state, step_lib.zero_metrics(), batch)
    assert seen == [jnp.float32]
