"""Properties of data parallelism, over k devices, batch sizes, seeds and learning rates."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

from helpers import torch_sgd_step

from experiments.measure import divergence
from jax_dp import assembly, data, parallel, step as step_lib, train
from jax_dp.backends import make_backend
from jax_dp.devices import get_devices

LENET = assembly.make_model("lenet")
EPS = np.finfo(np.float32).eps
ks = st.sampled_from([1, 2, 4, 8])
seeds = st.integers(0, 2**16)
few = settings(max_examples=3, deadline=None, derandomize=True)


def batch_of(n, seed):
    rng = np.random.default_rng(seed)
    return {"image": rng.random((n, 28, 28, 1), np.float32),
            "label": rng.integers(0, 10, n).astype(np.int32), "mask": np.ones(n, np.float32)}


@settings(max_examples=40, deadline=None, derandomize=True)
@given(k=ks, per_device=st.integers(1, 5), tail=st.lists(st.integers(1, 4), max_size=3),
       dtype=st.sampled_from([np.float32, np.int32, np.uint8]))
def test_split_and_load_then_merge_is_the_identity(k, per_device, tail, dtype):
    x = np.arange(k * per_device * int(np.prod(tail)), dtype=np.int64).reshape(k * per_device, *tail)
    x = x.astype(dtype)
    shards = parallel.split_and_load(x, get_devices(k))
    merged = np.asarray(shards).reshape(x.shape)
    assert merged.dtype == dtype
    np.testing.assert_array_equal(merged, x)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(k=ks, shape=st.lists(st.integers(1, 5), min_size=0, max_size=2), seed=seeds)
def test_allreduce_on_k_devices_equals_the_numpy_sum(k, shape, seed):
    x = np.random.default_rng(seed).normal(size=(k, *shape)).astype(np.float32)
    out = jax.pmap(parallel.allreduce, axis_name=parallel.AXIS, devices=get_devices(k))(x)
    # A sum of k float32 terms in some order: within (k - 1) ulps of their absolute sum.
    bound = (k - 1) * EPS * np.abs(x).sum(0)
    for replica in np.asarray(out):
        assert np.all(np.abs(replica - x.sum(0, dtype=np.float64)) <= bound + 1e-30)


def summed_loss(params, x, y):
    """The cross-entropy summed over the batch, with the convolutions the step's LeNet uses."""
    logits = LENET.apply(params, {}, x, None, train=True, axis_name=None)[0]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()


# Jitted: run op by op, each new batch size costs seconds of small compilations.
whole_grad = jax.jit(jax.grad(summed_loss))


@pytest.mark.parametrize("k", [2, 4])
def test_the_steps_allreduce_gives_every_device_the_whole_batchs_summed_gradient(k):
    """Catches the step's psum turned into a pmean, which its update cannot show (the gradients
    and the example count would shrink alike): each device's gradient and count, all-reduced
    as the step does (parallel.allreduce_flat), are the whole batch's."""
    from jax_dp.models.lenet import init_lenet

    rng = np.random.default_rng(k)
    params = init_lenet(jax.random.key(0), scale=0.3)
    x = rng.random((8 * k, 28, 28, 1)).astype(np.float32)
    y = rng.integers(0, 10, 8 * k).astype(np.int32)
    whole = whole_grad(params, x, y)

    def per_device(x, y):
        count = jnp.asarray(x.shape[0], jnp.float32)
        return parallel.allreduce_flat((jax.grad(summed_loss)(params, x, y), count), parallel.AXIS)

    grads, counts = jax.pmap(per_device, axis_name=parallel.AXIS, devices=get_devices(k))(
        x.reshape(k, 8, 28, 28, 1), y.reshape(k, 8))
    assert np.asarray(counts).tolist() == [8.0 * k] * k
    for device in range(k):
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(whole), strict=True):
            np.testing.assert_allclose(got[device], want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def last_gradient():
    """An optimizer that leaves the params alone and keeps, as its state, the gradient it got."""
    return optax.GradientTransformation(
        init=lambda params: jax.tree.map(jnp.zeros_like, params),
        update=lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


@functools.lru_cache(maxsize=None)
def pmap_program(k):
    return assembly.build(LENET, last_gradient(), "pmap", get_devices(k))


@jax.jit
def per_example_abs_grad_sum(params, x, y):
    """Sum over examples of |per-example gradient|: the scale of a batch gradient's round-off."""
    grads = jax.vmap(jax.grad(summed_loss), (None, 0, 0))(params, x[:, None], y[:, None])
    return jax.tree.map(lambda g: jnp.abs(g).sum(0), grads)


@few
@given(k=ks, per_device=st.integers(1, 3), seed=seeds)
def test_gradient_from_k_shards_equals_the_whole_batch_gradient(k, per_device, seed):
    b = batch_of(k * per_device, seed)
    params, model_state = LENET.init(jax.random.key(seed))
    whole = whole_grad(params, b["image"], b["label"])
    program = pmap_program(k)  # The gradient train_step itself hands the optimizer, on k devices.
    state = step_lib.TrainState(params, model_state, last_gradient().init(params))
    state, _ = program.train(program.backend.replicate(state),
                             program.backend.replicate(step_lib.zero_metrics()), program.backend.shard(b))
    split = program.backend.unreplicate(state).opt_state
    scale = per_example_abs_grad_sum(params, b["image"], b["label"])
    # Re-associating a sum of n terms moves it by at most ~2n eps times their absolute sum;
    # the step's mean divides by the B = k * per_device examples (one more rounding).
    n, batch = k * per_device * 26 * 26, k * per_device  # n: conv1's weight gradient's terms.
    for got, want, s in zip(jax.tree.leaves(split), jax.tree.leaves(whole), jax.tree.leaves(scale)):
        assert np.all(np.abs(got - want / batch) <= (2 * n * EPS * s + EPS * np.abs(want)) / batch + 1e-30)


@few
@given(k=ks, per_device=st.integers(2, 4), seed=seeds, lr=st.floats(0.01, 1.0))
def test_shuffling_a_batch_changes_the_update_only_by_round_off(k, per_device, seed, lr):
    b = batch_of(k * per_device, seed)
    perm = np.random.default_rng(seed + 1).permutation(k * per_device)
    shuffled = {name: v[perm] for name, v in b.items()}
    tx = optax.sgd(lr)
    program = assembly.build(LENET, tx, "pmap", get_devices(k))
    state = step_lib.init_state(LENET, tx, jax.random.key(seed))
    after = [program.backend.unreplicate(program.train(
        program.backend.replicate(state), program.backend.replicate(step_lib.zero_metrics()),
        program.backend.shard(batch))[0]).params for batch in (b, shuffled)]
    scale = per_example_abs_grad_sum(state.params, b["image"], b["label"])
    n = k * per_device * 26 * 26
    for x, y, s in zip(jax.tree.leaves(after[0]), jax.tree.leaves(after[1]), jax.tree.leaves(scale)):
        # The update is lr / B times a re-ordered sum: bound as above, plus an ulp of the params.
        bound = lr / (k * per_device) * 2 * n * EPS * s + EPS * np.abs(y)
        assert np.all(np.abs(x - y) <= bound + 1e-30)


def run(k, batches, lr=0.3):
    tx = optax.sgd(lr)
    program = assembly.build(LENET, tx, "pmap", get_devices(k))
    state = program.backend.replicate(step_lib.init_state(LENET, tx, jax.random.key(0)))
    metrics = program.backend.replicate(step_lib.zero_metrics())
    for batch in batches:
        state, metrics = program.train(state, metrics, program.backend.shard(batch))
    return state, program.wrapped["train"]


def test_pmap_and_fake_pmap_runs_equal_an_independent_pytorch_step(k=4):
    """Catches a step that pmap and chex.fake_pmap (vmap) compute alike but wrongly: one SGD
    step of each against PyTorch's autograd on the same params and batch, in float64."""
    batch, tx = batch_of(16, 0), optax.sgd(0.3)
    state = step_lib.init_state(LENET, tx, jax.random.key(0))
    with jax.enable_x64(True):
        state = divergence.cast(state, jnp.float64)
        b64 = divergence.cast(batch, jnp.float64)
        runs = {}
        for name in ("pmap", "fake_pmap"):
            with chex.fake_pmap(enable_patching=name == "fake_pmap"):
                program = assembly.build(LENET, tx, "pmap", get_devices(k))
                assert hasattr(program.wrapped["train"], "lower") == (name == "pmap")  # vmap, not pmap.
                b = program.backend
                # The vmap, jitted: one compilation instead of one per operation.
                step = program.train if name == "pmap" else jax.jit(program.train)
                out, _ = step(b.replicate(state), b.replicate(
                    divergence.cast(step_lib.zero_metrics(), jnp.float64)), b.shard(b64))
                runs[name] = b.unreplicate(out).params
    want = torch_sgd_step(state.params, batch, lr=0.3)
    for name, params in runs.items():
        for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12, err_msg=name)


@settings(max_examples=5, deadline=None, derandomize=True)
@given(k=ks, steps=st.integers(2, 6), seed=seeds)
def test_replicas_stay_bitwise_identical(k, steps, seed):
    state, _ = run(k, [batch_of(2 * k, seed + s) for s in range(steps)])
    for leaf in jax.tree.leaves(state):
        replicas = np.asarray(leaf)
        assert all(np.array_equal(replicas[0], r) for r in replicas[1:])


def traced_steps(k):
    """LeNet's pmapped step, traced lazily (not ahead of time) and allowed one trace only."""
    tx = optax.sgd(0.1)
    counted = functools.partial(chex.assert_max_traces(step_lib.train_step, n=1), model=LENET,
                                tx=tx, axis_name=parallel.AXIS)
    step = jax.pmap(counted, axis_name=parallel.AXIS, devices=get_devices(k))
    b = make_backend("pmap", get_devices(k))
    return step, b, b.replicate(step_lib.init_state(LENET, tx, jax.random.key(0)))


def test_padded_batches_compile_once_across_epochs():
    """Catches a batch of another shape (an unpadded last batch) that would recompile the step."""
    split = data.Split(np.random.default_rng(0).random((50, 28, 28, 1), np.float32),
                       np.arange(50, dtype=np.int32) % 10)
    step, b, state = traced_steps(4)
    metrics = b.replicate(step_lib.zero_metrics())
    try:  # 50 examples in batches of 16: the last batch of 2 is padded to 4, no second shape.
        for epoch in range(3):
            order = data.epoch_order(50, jax.random.key(epoch))
            for batch in data.batches(split, 16, pad_to=4, order=order):
                state, metrics = step(state, metrics, b.shard(batch))
        assert b.unreplicate(metrics)["count"] == 150
    finally:
        chex.clear_trace_counter()


def test_a_batch_of_another_shape_trips_the_trace_guard():
    step, b, state = traced_steps(2)
    metrics = b.replicate(step_lib.zero_metrics())
    try:
        state, metrics = step(state, metrics, b.shard(batch_of(16, 0)))
        with pytest.raises(AssertionError, match="traced > 1 times"):
            step(state, metrics, b.shard(batch_of(2, 1)))
    finally:
        chex.clear_trace_counter()


@settings(max_examples=15, deadline=None, derandomize=True)
@given(k=ks, n=st.integers(1, 40), batch_size=st.integers(1, 24), label=st.integers(0, 9))
def test_evaluation_counts_every_example_for_any_batch_size(k, n, batch_size, label):
    labels = np.random.default_rng(n).integers(0, 10, n).astype(np.int32)
    split = data.Split(np.zeros((n, 28, 28, 1), np.float32), labels)
    params = jax.tree.map(np.zeros_like, LENET.init(jax.random.key(0))[0])
    params["fc2"]["b"] = np.eye(10, dtype=np.float32)[label]  # Always predicts `label`.
    tx = optax.sgd(0.1)
    program = assembly.build(LENET, tx, "pmap", get_devices(k))
    totals = train.evaluate(program, program.backend.replicate(step_lib.TrainState(params, {}, tx.init(params))),
                            split, batch_size)
    assert totals["count"] == n and totals["correct"] == np.sum(labels == label)
