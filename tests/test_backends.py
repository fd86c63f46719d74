"""shard_map and jit backends, and the hand-made allreduces, against the single-device reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax_dp import allreduce, data, models, parallel, parity, train
from jax_dp.backends import make_backend
from jax_dp.devices import get_devices

from helpers import random_batches, run_steps

LENET = models.get_model("lenet")
BACKENDS = ["pmap", "shard_map", "jit"]


@pytest.fixture(scope="module")
def lenet_reference():
    return run_steps(LENET, "single", 1, random_batches(4, 32), lr=0.3)[1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [2, 8])
def test_every_backend_trains_lenet_like_one_device(lenet_reference, backend, k):
    _, got, metrics = run_steps(LENET, backend, k, random_batches(4, 32), lr=0.3)
    # As in test_train: float32 sums re-associated k ways, ~1e-7 of each update.
    assert parity.max_rel_diff(got.params, lenet_reference.params) <= 1e-6
    assert metrics["count"] == 4 * 32


@pytest.mark.parametrize("backend", ["shard_map", "jit"])
def test_replicated_state_stays_replicated_on_every_device(backend):
    placed, _, _ = run_steps(LENET, backend, 4, random_batches(1, 8), lr=0.3)
    for leaf in jax.tree.leaves(placed):
        assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 4


@pytest.fixture(scope="module")
def resnet_reference():
    with jax.enable_x64(True):
        return run_steps(models.get_model("resnet18"), "single", 1,
                         random_batches(2, 8, 8, np.float64), lr=0.1, dtype=jnp.float64)[1]


@pytest.mark.parametrize("backend", ["shard_map", "jit"])
def test_every_backend_keeps_batchnorm_statistics_global(resnet_reference, backend):
    with jax.enable_x64(True):  # float64: exactness, not float32 sensitivity (test_resnet).
        _, got, _ = run_steps(models.get_model("resnet18"), backend, 4,
                              random_batches(2, 8, 8, np.float64), lr=0.1, dtype=jnp.float64)
    assert parity.max_rel_diff(got.params, resnet_reference.params) <= 1e-9
    assert parity.max_rel_diff(got.model_state, resnet_reference.model_state) <= 1e-9


@pytest.mark.parametrize("backend", BACKENDS)
def test_train_and_evaluate_run_on_every_backend(backend):
    rng = np.random.default_rng(0)
    split = data.Split(rng.random((37, 28, 28, 1), np.float32), rng.integers(0, 10, 37).astype(np.int32))
    history = train.train(LENET, split, split, get_devices(4), backend=backend, batch_size=10,
                          epochs=1, log=lambda _: None)
    assert 0 <= history["epochs"][0]["test_acc"] <= 1


@pytest.mark.parametrize("scheme", ["star", "ring"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_hand_made_allreduce_matches_psum(scheme, k):
    rng = np.random.default_rng(k)
    x = {"w": rng.normal(size=(k, 5, 7)).astype(np.float32), "b": rng.normal(size=(k, 3)).astype(np.float32)}
    mapped = lambda fn: jax.pmap(fn, axis_name=parallel.AXIS, devices=get_devices(k))(x)
    got, want = mapped(allreduce.ALLREDUCES[scheme]), mapped(parallel.allreduce)
    for name in x:
        replicas = np.asarray(got[name])
        assert all(np.array_equal(replicas[0], r) for r in replicas[1:])  # One sum, copied.
        # Both sum the same k float32 terms, in another order: (k - 1) ulps of |terms|.
        bound = (k - 1) * np.finfo(np.float32).eps * np.abs(x[name]).sum(0)
        assert np.all(np.abs(replicas[0] - np.asarray(want[name])[0]) <= bound + 1e-30)


@pytest.mark.parametrize("scheme", ["star", "ring"])
def test_training_with_a_hand_made_allreduce_matches_psum(lenet_reference, scheme):
    _, got, _ = run_steps(LENET, "pmap", 4, random_batches(4, 32), lr=0.3, grad_allreduce=scheme)
    assert parity.max_rel_diff(got.params, lenet_reference.params) <= 1e-6


def test_traffic_per_device():
    n = 129_068 * 4  # LeNet's gradients in bytes.
    assert allreduce.bytes_sent("star", n, 4) == [3 * n, n, n, n]
    assert allreduce.bytes_sent("ring", n, 4) == [2 * 3 * (n // 4)] * 4
    assert max(allreduce.bytes_sent("ring", n, 8)) < max(allreduce.bytes_sent("star", n, 8)) / 3


def test_hand_made_allreduce_needs_pmap_and_unknown_names_are_refused():
    with pytest.raises(ValueError, match="--allreduce ring is written for the pmap backend"):
        train.make_steps(LENET, optax.sgd(0.1), make_backend("jit", get_devices(2)), "ring")
    with pytest.raises(ValueError, match="unknown --allreduce 'tree'"):
        train.make_steps(LENET, optax.sgd(0.1), make_backend("pmap", get_devices(2)), "tree")
    with pytest.raises(ValueError, match="unknown backend 'xmap'"):
        make_backend("xmap", get_devices(2))


def test_under_shard_map_the_reduced_view_is_what_stops_double_counting():
    from jax.sharding import Mesh, PartitionSpec as P

    k = 4
    mesh = Mesh(np.array(get_devices(k)), (parallel.AXIS,))
    w = np.random.default_rng(0).normal(size=(3,)).astype(np.float32)
    x = np.random.default_rng(1).normal(size=(8, 3)).astype(np.float32)
    whole = jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)

    def summed_grad(use_reduced):
        def body(w, x):
            view = parallel.reduced(w, parallel.AXIS, x) if use_reduced else w
            return parallel.allreduce(jax.grad(lambda v: jnp.sum((x @ v) ** 2))(view))
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(parallel.AXIS)),
                                     out_specs=P()))(w, x)

    np.testing.assert_allclose(summed_grad(True), whole, rtol=1e-5)
    np.testing.assert_allclose(summed_grad(False), k * whole, rtol=1e-5)  # Counted k times.
