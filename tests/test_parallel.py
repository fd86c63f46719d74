"""The data-parallel primitives: replicate, split, allreduce."""

import jax
import numpy as np
import pytest

from jax_dp import parallel
from jax_dp.devices import get_devices

COUNTS = [1, 2, 4, 8]


@pytest.mark.parametrize("k", COUNTS)
def test_split_and_load_puts_shard_i_on_device_i_and_merges_back(k):
    devs = get_devices(k)
    x = np.arange(24 * k * 3, dtype=np.float32).reshape(24 * k // 2, 2, 3)
    shards = parallel.split_and_load(x, devs)
    assert shards.shape == (k, x.shape[0] // k, 2, 3)
    for i, d in enumerate(devs):
        shard = shards.addressable_data(i)
        assert shard.devices() == {d}
        np.testing.assert_array_equal(np.asarray(shard)[0], x[i * x.shape[0] // k:(i + 1) * x.shape[0] // k])
    np.testing.assert_array_equal(np.asarray(shards).reshape(x.shape), x)


def test_split_and_load_splits_every_leaf_of_a_batch():
    devs = get_devices(2)
    batch = {"image": np.zeros((6, 4), np.float32), "label": np.arange(6)}
    out = parallel.split_and_load(batch, devs)
    assert out["image"].shape == (2, 3, 4)
    np.testing.assert_array_equal(np.asarray(out["label"]), [[0, 1, 2], [3, 4, 5]])


@pytest.mark.parametrize("n", [1, 5, 7])
def test_split_and_load_refuses_uneven_batches(n):
    with pytest.raises(ValueError, match=f"batch of {n} examples does not split evenly over 4"):
        parallel.split_and_load(np.zeros((n, 3)), get_devices(4))


def test_split_and_load_refuses_scalars():
    with pytest.raises(ValueError, match="batch axis"):
        parallel.split_and_load(np.float32(1), get_devices(2))


@pytest.mark.parametrize("k", COUNTS)
def test_get_params_copies_every_leaf_to_every_device(k):
    devs = get_devices(k)
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.float32(2.5)}
    replicated = parallel.get_params(params, devs)
    assert replicated["w"].shape == (k, 2, 3)
    for i, d in enumerate(devs):
        assert replicated["w"].addressable_data(i).devices() == {d}
        np.testing.assert_array_equal(np.asarray(replicated["w"].addressable_data(i))[0], params["w"])
    back = parallel.unreplicate(replicated)
    np.testing.assert_array_equal(back["w"], params["w"])
    assert back["b"] == params["b"]


@pytest.mark.parametrize("k", COUNTS)
def test_allreduce_equals_the_sum_over_devices(k):
    devs = get_devices(k)
    x = np.random.default_rng(k).normal(size=(k, 3, 5)).astype(np.float32)
    summed = jax.pmap(parallel.allreduce, axis_name=parallel.AXIS, devices=devs)(
        parallel.split_and_load(x.reshape(k * 3, 5), devs))
    for i in range(k):  # Every device holds the same sum.
        np.testing.assert_allclose(np.asarray(summed)[i], x.sum(0), rtol=1e-6, atol=1e-6)


def test_allreduce_without_an_axis_is_the_identity():
    x = {"a": np.ones(3)}
    assert parallel.allreduce(x, None) is x


def test_the_books_allreduce_example():
    devs = get_devices(2)
    data = np.array([[1.0, 1.0], [2.0, 2.0]], np.float32)  # [[1, 1]] on device 0, [[2, 2]] on 1.
    out = jax.pmap(parallel.allreduce, axis_name=parallel.AXIS, devices=devs)(
        parallel.split_and_load(data, devs))
    np.testing.assert_array_equal(np.asarray(out), [[[3.0, 3.0]], [[3.0, 3.0]]])
