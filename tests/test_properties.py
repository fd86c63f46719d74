"""Properties of data parallelism, over k devices, batch sizes, seeds and learning rates."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

from jax_dp import data, models, parallel, train
from jax_dp.backends import make_backend
from jax_dp.devices import get_devices

LENET = models.get_model("lenet")
EPS = np.finfo(np.float32).eps
ks = st.sampled_from([1, 2, 4, 8])
seeds = st.integers(0, 2**16)
few = settings(max_examples=8, deadline=None, derandomize=True)


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
    return optax.softmax_cross_entropy_with_integer_labels(models.lenet(params, x), y).sum()


@functools.lru_cache(maxsize=None)
def sharded_grad(k):
    grad = lambda p, x, y: parallel.allreduce(jax.grad(summed_loss)(p, x, y))
    return jax.pmap(grad, axis_name=parallel.AXIS, in_axes=(None, 0, 0), devices=get_devices(k))


def per_example_abs_grad_sum(params, x, y):
    """Sum over examples of |per-example gradient|: the scale of a batch gradient's round-off."""
    grads = jax.vmap(jax.grad(summed_loss), (None, 0, 0))(params, x[:, None], y[:, None])
    return jax.tree.map(lambda g: jnp.abs(g).sum(0), grads)


@few
@given(k=ks, per_device=st.integers(1, 3), seed=seeds)
def test_gradient_from_k_shards_equals_the_whole_batch_gradient(k, per_device, seed):
    b = batch_of(k * per_device, seed)
    params = LENET.init(jax.random.key(seed))[0]
    whole = jax.grad(summed_loss)(params, b["image"], b["label"])
    shards = parallel.split_and_load({"x": b["image"], "y": b["label"]}, get_devices(k))
    split = parallel.unreplicate(sharded_grad(k)(params, shards["x"], shards["y"]))
    scale = per_example_abs_grad_sum(params, b["image"], b["label"])
    # Re-associating a sum of n terms moves it by at most ~2n eps times their absolute sum.
    n = k * per_device * 26 * 26  # Terms in the largest reduction (conv1's weight gradient).
    for got, want, s in zip(jax.tree.leaves(split), jax.tree.leaves(whole), jax.tree.leaves(scale)):
        assert np.all(np.abs(got - want) <= 2 * n * EPS * s + 1e-30)


@few
@given(k=ks, per_device=st.integers(2, 4), seed=seeds, lr=st.floats(0.01, 1.0))
def test_shuffling_a_batch_changes_the_update_only_by_round_off(k, per_device, seed, lr):
    b = batch_of(k * per_device, seed)
    perm = np.random.default_rng(seed + 1).permutation(k * per_device)
    shuffled = {name: v[perm] for name, v in b.items()}
    tx = optax.sgd(lr)
    steps = train.make_steps(LENET, tx, make_backend("pmap", get_devices(k)))
    state = train.init_state(LENET, tx, jax.random.key(seed))
    after = [steps.backend.unreplicate(steps.train_batch(
        steps.backend.replicate(state), steps.backend.replicate(train.zero_metrics()),
        steps.backend.shard(batch))[0]).params for batch in (b, shuffled)]
    scale = per_example_abs_grad_sum(state.params, b["image"], b["label"])
    n = k * per_device * 26 * 26
    for x, y, s in zip(jax.tree.leaves(after[0]), jax.tree.leaves(after[1]), jax.tree.leaves(scale)):
        # The update is lr / B times a re-ordered sum: bound as above, plus an ulp of the params.
        bound = lr / (k * per_device) * 2 * n * EPS * s + EPS * np.abs(y)
        assert np.all(np.abs(x - y) <= bound + 1e-30)


def run(k, batches, lr=0.3):
    tx = optax.sgd(lr)
    steps = train.make_steps(LENET, tx, make_backend("pmap", get_devices(k)))
    state = steps.backend.replicate(train.init_state(LENET, tx, jax.random.key(0)))
    metrics = steps.backend.replicate(train.zero_metrics())
    for batch in batches:
        state, metrics = steps.train_batch(state, metrics, steps.backend.shard(batch))
    return state, steps.train_batch


@pytest.mark.parametrize("k", [2, 4])
def test_a_run_under_fake_pmap_equals_the_real_pmap_run(k):
    batches = [batch_of(16, s) for s in range(3)]
    real_state, real_step = run(k, batches)
    with chex.fake_pmap():
        fake_state, fake_step = run(k, batches)
    assert hasattr(real_step, "lower") and not hasattr(fake_step, "lower")  # vmap, not pmap.
    real, fake = parallel.unreplicate(real_state.params), parallel.unreplicate(fake_state.params)
    # vmap computes the same per-shard sums in one program: round-off apart, nothing else.
    chex.assert_trees_all_close(fake, real, rtol=1e-5, atol=1e-8)


@settings(max_examples=5, deadline=None, derandomize=True)
@given(k=ks, steps=st.integers(2, 6), seed=seeds)
def test_replicas_stay_bitwise_identical(k, steps, seed):
    state, _ = run(k, [batch_of(2 * k, seed + s) for s in range(steps)])
    for leaf in jax.tree.leaves(state):
        replicas = np.asarray(leaf)
        assert all(np.array_equal(replicas[0], r) for r in replicas[1:])


def test_one_compilation_per_shape_across_epochs(monkeypatch):
    counted = chex.assert_max_traces(train.train_step, n=1)
    monkeypatch.setattr(train, "train_step", counted)
    split = data.Split(np.random.default_rng(0).random((50, 28, 28, 1), np.float32),
                       np.arange(50, dtype=np.int32) % 10)
    # 50 examples in batches of 16: the last batch of 2 is padded, so no second shape.
    history = train.train(LENET, split, split, get_devices(4), batch_size=16, epochs=3,
                          log=lambda _: None)
    assert len(history["epochs"]) == 3
    chex.clear_trace_counter()


@settings(max_examples=15, deadline=None, derandomize=True)
@given(k=ks, n=st.integers(1, 40), batch_size=st.integers(1, 24), label=st.integers(0, 9))
def test_evaluation_counts_every_example_for_any_batch_size(k, n, batch_size, label):
    labels = np.random.default_rng(n).integers(0, 10, n).astype(np.int32)
    split = data.Split(np.zeros((n, 28, 28, 1), np.float32), labels)
    params = jax.tree.map(np.zeros_like, LENET.init(jax.random.key(0))[0])
    params["fc2"]["b"] = np.eye(10, dtype=np.float32)[label]  # Always predicts `label`.
    tx = optax.sgd(0.1)
    steps = train.make_steps(LENET, tx, make_backend("pmap", get_devices(k)))
    totals = train.evaluate(steps, steps.backend.replicate(train.TrainState(params, {}, tx.init(params))),
                            split, batch_size)
    assert totals["count"] == n and totals["correct"] == np.sum(labels == label)
