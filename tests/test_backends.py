"""shard_map and jit backends, and the hand-made allreduces, against the single-device reference."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dp import assembly, data, parallel, schemes, train
from experiments.measure import divergence
from jax_dp.config import TrainConfig
from jax_dp.devices import get_devices

import tiny_resnet
from helpers import numpy_lenet, random_batches, run_steps

LENET = assembly.make_model("lenet")
TINY_RESNET = tiny_resnet.make()  # ResNet-18's code and BatchNorm, narrow and one block a stage.
BACKENDS = ["pmap", "shard_map", "jit"]


@pytest.fixture(scope="module")
def lenet_reference():
    return run_steps(LENET, "single", 1, random_batches(4, 32), lr=0.3)[1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [2, 8])
def test_every_backend_trains_lenet_like_one_device(lenet_reference, backend, k):
    _, got, metrics = run_steps(LENET, backend, k, random_batches(4, 32), lr=0.3)
    # As in test_train: float32 sums re-associated k ways, ~1e-7 of each update.
    assert divergence.max_rel_diff(got.params, lenet_reference.params) <= 1e-6
    assert metrics["count"] == 4 * 32


@pytest.mark.parametrize("backend", ["shard_map", "jit"])
def test_replicated_state_stays_replicated_on_every_device(backend):
    placed, _, _ = run_steps(LENET, backend, 4, random_batches(1, 8), lr=0.3)
    for leaf in jax.tree.leaves(placed):
        assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 4


@pytest.fixture(scope="module")
def resnet_reference():
    with jax.enable_x64(True):
        return run_steps(TINY_RESNET, "single", 1,
                         random_batches(2, 8, 8, np.float64), lr=0.1, dtype=jnp.float64)[1]


@pytest.mark.parametrize("backend", ["shard_map", "jit"])
def test_every_backend_keeps_batchnorm_statistics_global(resnet_reference, backend):
    with jax.enable_x64(True):  # float64: exactness, not float32 sensitivity (test_resnet).
        _, got, _ = run_steps(TINY_RESNET, backend, 4,
                              random_batches(2, 8, 8, np.float64), lr=0.1, dtype=jnp.float64)
    assert divergence.max_rel_diff(got.params, resnet_reference.params) <= 1e-9
    assert divergence.max_rel_diff(got.model_state, resnet_reference.model_state) <= 1e-9


def test_training_learns_fashion_mnist_and_reports_its_true_accuracy(fashion_train_6k, fashion_test):
    """Catches a loop that does not learn (chance is 0.1; three epochs of 6,000 images reach
    about 0.65) or that misreports accuracy (it must be a numpy forward pass's)."""
    train_split = fashion_train_6k
    test_split = data.Split(fashion_test.images[:2000], fashion_test.labels[:2000])
    config = TrainConfig(devices=2, batch_size=32, lr=0.3, epochs=3, train_examples=6000,
                         test_examples=2000)
    run = train.train(config, train_split, test_split, log=lambda _: None)
    losses = [e["train_loss"] for e in run["epochs"]]
    # The book's Normal(0, 0.01) init starts at chance (loss ln 10) and stays there a while.
    assert losses[0] < np.log(10) + 0.01 and losses[-1] < 1.5, losses
    accuracy = run["epochs"][-1]["test_acc"]
    assert accuracy > 0.5
    assert_is_numpys_accuracy(accuracy, run["state"].params, test_split)


def assert_is_numpys_accuracy(accuracy, params, split):
    """accuracy is a float64 numpy forward pass's, but for images whose two top logits are
    so close that float32 round-off may swap them (usually none)."""
    logits = numpy_lenet(params, split.images)
    top2 = np.sort(logits, 1)[:, -2:]
    ties = np.sum(top2[:, 1] - top2[:, 0] <= 1e-5 * np.abs(logits).max())
    correct = np.sum(logits.argmax(1) == split.labels)
    assert abs(round(accuracy * len(split.labels)) - correct) <= ties


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_trains_and_reports_the_accuracy_of_its_final_params(backend):
    """Catches a backend whose train() loop or evaluation differs from one device's: its params
    after two epochs on 4 devices equal the single backend's, and its accuracy is a numpy
    forward pass's."""
    rng = np.random.default_rng(0)
    split = data.Split(rng.random((37, 28, 28, 1), np.float32), rng.integers(0, 10, 37).astype(np.int32))
    runs = [train.train(TrainConfig(backend=b, devices=k, batch_size=10, lr=0.3, epochs=2,
                                    train_examples=37, test_examples=37), split, split,
                        log=lambda _: None) for b, k in (("single", 1), (backend, 4))]
    assert [e["train_loss"] for e in runs[1]["epochs"]] == pytest.approx(
        [e["train_loss"] for e in runs[0]["epochs"]], rel=1e-5)
    assert divergence.max_rel_diff(runs[1]["state"].params, runs[0]["state"].params) <= 1e-6
    assert_is_numpys_accuracy(runs[1]["epochs"][-1]["test_acc"], runs[1]["state"].params, split)


@pytest.mark.parametrize("scheme", sorted(schemes.BY_NAME))
@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_every_allreduce_gives_every_device_the_exact_sum(scheme, k):
    """Catches a star or ring that adds where it should set, drops a device's share, or
    misplaces a chunk: in float64, on sizes that do (24) and do not (1, 7, 1003) divide
    into k chunks, each device gets the sum to round-off."""
    rng = np.random.default_rng(k)
    tree = {"a": rng.normal(size=(k, 1)), "b": rng.normal(size=(k, 7)),
            "c": rng.normal(size=(k, 24)), "d": rng.normal(size=(k, 1003))}
    with jax.enable_x64(True):
        out = jax.pmap(schemes.BY_NAME[scheme], axis_name=parallel.AXIS,
                       devices=get_devices(k))(tree)
    for name, x in tree.items():
        bound = 2 * (k - 1) * np.finfo(np.float64).eps * np.abs(x).sum(0) + 1e-300
        assert out[name].dtype == np.float64
        for replica in np.asarray(out[name]):
            assert np.all(np.abs(replica - x.sum(0)) <= bound), (name, replica - x.sum(0))


def hlo_bytes_sent(scheme, size, k):
    """Bytes each device sends in the compiled all-reduce: every collective-permute's operand,
    counted for each device that is a source in its source_target_pairs."""
    x = np.ones((k, size), np.float32)
    step = jax.pmap(schemes.BY_NAME[scheme], axis_name=parallel.AXIS, devices=get_devices(k))
    sent = [0] * k
    for line in step.lower(x).compile().as_text().splitlines():
        match = re.search(r"= f32\[(\d+)\]\S* collective-permute\(.*source_target_pairs=\{(.*?)\}\}", line)
        if match:
            for source in re.findall(r"\{(\d+),\d+", match.group(2) + "}"):
                sent[int(source)] += int(match.group(1)) * 4
    return sent


@pytest.mark.parametrize("scheme", ["star", "ring"])
@pytest.mark.parametrize("k,size", [(2, 1000), (4, 1003), (8, 129_068)])
def test_traffic_per_device_is_what_the_compiled_program_sends(scheme, k, size):
    """Catches a traffic formula that is not the code's (the ring pads to k chunks) and an
    all-reduce that sends more than it should."""
    assert schemes.bytes_sent(scheme, size, k) == hlo_bytes_sent(scheme, size, k)


def test_the_ring_sends_less_than_the_star_from_its_busiest_device():
    n = 129_068
    assert max(schemes.bytes_sent("ring", n, 8)) < max(schemes.bytes_sent("star", n, 8)) / 3


def test_hand_made_allreduce_needs_pmap_and_unknown_ones_are_refused():
    with pytest.raises(ValueError, match="allreduce ring is written for the pmap backend"):
        schemes.get_allreduce("ring", "jit")
    with pytest.raises(ValueError, match="unknown allreduce 'tree'"):
        schemes.get_allreduce("tree", "pmap")
