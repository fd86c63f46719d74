"""The exact mode: the same float32 bits on 1, 2, 4 and 8 devices, for pmap and shard_map,
for LeNet and for ResNet-18 with its BatchNorm statistics synchronised."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

from jax_dp import assembly, data, step as step_lib, train
from jax_dp.exact import micro
from jax_dp.config import MICRO_BATCHES, RunOptions, TrainConfig
from jax_dp.devices import get_devices
from jax_dp.errors import ParamError

LENET = assembly.make_model("lenet")
# ResNet-18's code with its synchronised BatchNorm, narrow (tests/tiny_resnet.py): the same
# layers and sums at a fraction of the compile time.
RESNET = assembly.make_model("tests.tiny_resnet")


# Each device count once, the two backends taking turns (tests/test_elastic.py resumes a run
# across every pair of counts on both).
EACH_K = [("pmap", 1), ("shard_map", 2), ("pmap", 4), ("shard_map", 8)]


def bits(tree):
    return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def twenty_batches(fashion_train_6k):
    """20 batches of 256 real Fashion-MNIST images in a shuffled order, the last only 37 real."""
    order = np.random.default_rng(0).permutation(len(fashion_train_6k.labels))[:19 * 256 + 37]
    split = data.Split(fashion_train_6k.images[order], fashion_train_6k.labels[order])
    return list(data.batches(split, 256, pad_to=MICRO_BATCHES))


def exact_run(backend, k, batches, model=LENET, lr=0.1):
    """SGD steps with momentum (an optimizer state to compare): the state, and each step's
    metrics (a running sum would round a last-bit difference of one step away)."""
    tx = optax.sgd(lr, momentum=0.9)
    program = assembly.build(model, tx, backend, get_devices(k), exact=True)
    b = program.backend
    state, per_step = b.replicate(step_lib.init_state(model, tx, jax.random.key(0))), []
    for batch in batches:
        state, metrics = program.train(state, b.replicate(step_lib.zero_metrics()), b.shard(batch))
        per_step.append(b.unreplicate(metrics))
    return b.unreplicate(state), per_step


@pytest.fixture(scope="module")
def one_device(twenty_batches):
    return exact_run("single", 1, twenty_batches)


@pytest.mark.parametrize("backend, k", EACH_K)
def test_k_devices_give_one_devices_bits_after_20_steps(twenty_batches, one_device, backend, k):
    """Catches any sum whose order follows k: params, optimizer state, loss sum and counts."""
    state, metrics = exact_run(backend, k, twenty_batches)
    assert bits(state) == bits(one_device[0])
    assert bits(metrics) == bits(one_device[1])
    assert sum(m["count"] for m in metrics) == 19 * 256 + 37


@pytest.fixture(scope="module")
def five_batches(fashion_train_6k):
    """5 batches of 16 real Fashion-MNIST images (2 per micro-batch), the last only 5 real."""
    return list(data.batches(data.Split(fashion_train_6k.images[:4 * 16 + 5],
                                        fashion_train_6k.labels[:4 * 16 + 5]), 16, pad_to=MICRO_BATCHES))


@pytest.fixture(scope="module")
def resnet_one_device(five_batches):
    return exact_run("single", 1, five_batches, RESNET, lr=0.05)


@pytest.mark.parametrize("backend, k", EACH_K)
def test_a_resnet_on_k_devices_gives_one_devices_bits_after_5_steps(five_batches, resnet_one_device,
                                                                      backend, k):
    """With BatchNorm synchronised: params, BatchNorm statistics, optimizer state, metrics."""
    state, metrics = exact_run(backend, k, five_batches, RESNET, lr=0.05)
    assert bits(state.model_state) == bits(resnet_one_device[0].model_state)
    assert bits(state) == bits(resnet_one_device[0])
    assert bits(metrics) == bits(resnet_one_device[1])
    assert sum(m["count"] for m in metrics) == 4 * 16 + 5


def test_the_normal_mode_is_not_exact(twenty_batches, one_device):
    """The comparison can fail: psum's sums on 8 devices move the bits."""
    tx = optax.sgd(0.1, momentum=0.9)
    program = assembly.build(LENET, tx, "pmap", get_devices(8))
    b = program.backend
    state, metrics = b.replicate(step_lib.init_state(LENET, tx, jax.random.key(0))), \
        b.replicate(step_lib.zero_metrics())
    for batch in twenty_batches:
        state, metrics = program.train(state, metrics, b.shard(batch))
    assert bits(b.unreplicate(state).params) != bits(one_device[0].params)


def test_the_tree_is_the_same_on_one_device_and_across_devices():
    x = np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32)
    want = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]))
    assert np.asarray(micro.tree_sum(x)).tobytes() == want.tobytes()
    for k in (2, 4, 8):
        blocks = x.reshape(k, 8 // k, 5)
        summed = jax.pmap(lambda b: micro.doubling_sum(micro.tree_sum(b), "d"), axis_name="d",
                          devices=get_devices(k))(blocks)
        for device in np.asarray(summed):
            assert device.tobytes() == want.tobytes()


@pytest.mark.parametrize("fields, message", [
    ({"backend": "jit", "devices": 2}, "exact needs its sums in a fixed order, and under backend "
                                       "jit XLA inserts its own all-reduces: use pmap or shard_map"),
    ({"devices": 3}, "exact cuts each batch into 8 micro-batches, which devices 3 does not divide"),
    ({"allreduce": "ring", "devices": 2}, "exact sums in its own fixed tree: leave allreduce psum"),
])
def test_what_cannot_be_exact_is_refused(fields, message):
    with pytest.raises(ParamError, match=message):
        TrainConfig(exact=True, **fields)


def test_per_device_batch_statistics_are_refused():
    """bn local: each device's statistics are of its own shard, so they follow k."""
    with pytest.raises(ParamError, match="exact needs a model with batch statistics to run each "
                                         "layer on micro-batches"):
        assembly.build(assembly.make_model("resnet18", bn="local"), optax.sgd(0.1),
                               "pmap", get_devices(2), exact=True)


def test_the_command_line_trains_1_and_2_devices_to_one_history(tmp_path):
    out = tmp_path / "runs.json"
    proc = subprocess.run([sys.executable, "-m", "experiments.lenet", "--exact", "--devices", "1,2",
                           "--train-examples", "600", "--test-examples", "300", "--batch-size", "64",
                           "--epochs", "2", "--no-progress", "--json", str(out)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_DP_NO_TCMALLOC": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "exact=True" in proc.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [[{k: v for k, v in e.items() if k != "time_s"} for e in r["epochs"]] for r in runs] == \
        [[{k: v for k, v in e.items() if k != "time_s"} for e in runs[0]["epochs"]]] * 2


def test_steps_per_call_keep_the_bits(fashion_train_6k):
    """Many steps per compiled call (under lax.scan) give the exact mode's bits too."""
    split = data.Split(fashion_train_6k.images[:600], fashion_train_6k.labels[:600])
    config = TrainConfig(exact=True, devices=2, batch_size=64, lr=0.1, epochs=1,
                         train_examples=600, test_examples=600)
    runs = [train.train(config, split, split,
                        RunOptions(steps_per_call=n), log=lambda _: None) for n in (1, 3)]
    assert bits(runs[0]["state"]) == bits(runs[1]["state"])
