"""The train step: k devices equal one, replicas agree, evaluation counts everything."""

import datetime
import itertools
import re

import chex
import jax
import numpy as np
import optax
import pytest

from jax_dp import assembly, data, progress, step as step_lib, train
from jax_dp.models.lenet import lenet
from jax_dp.models.model import Model
from jax_dp.config import RunOptions, TrainConfig
from jax_dp.devices import get_devices
from jax_dp.errors import ParamError

from helpers import random_batches, run_steps

LENET = assembly.make_model("lenet")


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_pmap_on_k_devices_equals_one_device(k):
    batches = random_batches(5, 32)
    _, single, m1 = run_steps(LENET, "single", 1, batches, lr=0.5)
    _, pmapped, mk = run_steps(LENET, "pmap", k, batches, lr=0.5)
    # Only the order of float32 additions differs (a batch's gradient is a sum of 32 terms,
    # split into k partial sums): each step's update differs by a few ulps of its size,
    # ~1e-7 relative, and five steps at this lr move params by less than 1e-6.
    chex.assert_trees_all_close(pmapped.params, single.params, rtol=1e-5, atol=1e-7)
    assert mk["count"] == m1["count"] == 5 * 32
    np.testing.assert_allclose(mk["loss_sum"], m1["loss_sum"], rtol=1e-6)


def test_the_step_averages_over_the_global_batch():
    # One SGD step by hand: params - lr * mean over the batch of per-example gradients.
    (batch,) = random_batches(1, 8)
    params = LENET.init(jax.random.key(0))[0]

    def loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(lenet(p, x[None]), y[None])[0]

    grads = jax.jit(jax.vmap(jax.grad(loss), (None, 0, 0)))(params, batch["image"], batch["label"])
    expected = jax.tree.map(lambda p, g: p - 0.5 * g.mean(0), params, grads)
    _, got, _ = run_steps(LENET, "pmap", 4, [batch], lr=0.5)
    chex.assert_trees_all_close(got.params, expected, rtol=1e-5, atol=1e-8)


def test_replicas_stay_bitwise_identical():
    state, _, _ = run_steps(LENET, "pmap", 8, random_batches(5, 64), lr=0.5)
    for leaf in jax.tree.leaves(state.params):
        replicas = np.asarray(leaf)
        assert all(np.array_equal(replicas[0], r) for r in replicas[1:])


def constant_prediction_state(k, label):
    """A LeNet whose every prediction is `label`: zero weights, a bias that picks it."""
    params = jax.tree.map(np.zeros_like, LENET.init(jax.random.key(0))[0])
    params["fc2"]["b"] = np.eye(10, dtype=np.float32)[label]
    tx = optax.sgd(0.1)
    program = assembly.build(LENET, tx, "pmap", get_devices(k))
    return program, program.backend.replicate(step_lib.TrainState(params, {}, tx.init(params)))


@pytest.mark.parametrize("k,batch_size", [(1, 3), (2, 4), (4, 7), (8, 5)])
def test_evaluate_accuracy_is_exact_on_a_constructed_case(k, batch_size):
    labels = np.array([3, 3, 1, 3, 0, 9, 3, 2, 2, 5, 3], np.int32)  # 5 of 11 are 3.
    split = data.Split(np.zeros((11, 28, 28, 1), np.float32), labels)
    program, state = constant_prediction_state(k, 3)
    assert train.evaluate_accuracy(program, state, split, batch_size) == 5 / 11


@pytest.mark.parametrize("k,batch_size", [(1, 999), (2, 256), (8, 333)])
def test_evaluation_counts_all_10000_test_examples(fashion_test, k, batch_size):
    assert 10_000 % batch_size
    program, state = constant_prediction_state(k, 7)
    totals = train.evaluate(program, state, fashion_test, batch_size)
    assert totals["count"] == 10_000
    assert totals["correct"] == 1_000  # Exactly the test set's 1,000 images of class 7.


@pytest.mark.timeout(300)  # About 30 s; a deadlock would otherwise wait for the global 900 s.
def test_1000_pmapped_steps_on_8_devices_finish():
    # XLA:CPU's all-reduce rendezvous can deadlock if the host queues steps without
    # ever waiting; the loop bounds what is in flight, so this must simply finish.
    rng = np.random.default_rng(0)
    split = data.Split(rng.random((8000, 28, 28, 1), np.float32),
                       rng.integers(0, 10, 8000).astype(np.int32))
    config = TrainConfig(devices=8, batch_size=8, epochs=1, train_examples=8000, test_examples=8)
    run = train.train(config, split, data.Split(split.images[:8], split.labels[:8]),
                      log=lambda _: None)
    assert run["epochs"][0]["train_acc"] * 8000 == pytest.approx(
        round(run["epochs"][0]["train_acc"] * 8000))


@pytest.mark.parametrize("options,message", [
    ({"checkpoint_every": -1}, "checkpoint_every must be 0 (epoch ends only) or more, got -1"),
    ({"checkpoint_every": 5}, "resume and checkpoint_every need checkpoint_dir"),
    ({"resume": True}, "resume and checkpoint_every need checkpoint_dir"),
    ({"log_every": -1.0}, "log_every must be a finite number of seconds, 0 or more, got -1.0"),
    ({"log_every": float("inf")}, "log_every must be a finite number of seconds, 0 or more, got inf"),
    ({"profile": (3, 3), "logdir": "tb"}, "profile must be START:STOP, global steps with 0 <= "
                                          "START < STOP, and a logdir for the trace, got 3:3"),
    ({"profile": (0, 2)}, "profile must be START:STOP, global steps with 0 <= START < STOP, and "
                          "a logdir for the trace, got 0:2"),
    ({"scalars_every": 0}, "scalars_every must be a whole number of steps, 1 or more, got 0"),
])
def test_run_options_that_cannot_work_are_refused(options, message):
    with pytest.raises(ParamError) as e:
        RunOptions(**options)
    assert str(e.value) == message


def test_each_epoch_has_its_own_order_fixed_by_the_key_and_the_epoch():
    """Catches every epoch shuffled alike (the resume tests compare runs that would share the
    bug): consecutive epochs' orders differ, each a permutation that the key and epoch fix, and
    the run loop trains each epoch in its own."""
    config = TrainConfig(batch_size=16, epochs=3, train_examples=64, test_examples=16)
    key = jax.random.key(config.seed)
    orders = [train.epoch_order(config, key, epoch) for epoch in range(3)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(64))
    assert not any(np.array_equal(a, b) for a, b in itertools.combinations(orders, 2))
    assert np.array_equal(train.epoch_order(config, key, 1), orders[1])
    assert not np.array_equal(train.epoch_order(config, jax.random.key(1), 1), orders[1])
    seen = {}
    split = data.Split(np.zeros((64, 28, 28, 1), np.float32), np.zeros(64, np.int32))
    train.train(config, split, data.Split(split.images[:16], split.labels[:16]), log=lambda _: None,
                on_step=lambda position: seen.setdefault(position.epoch, position.order))
    assert [seen[epoch].tolist() for epoch in range(3)] == [order.tolist() for order in orders]


def test_the_warmup_schedule_rises_linearly_over_its_steps_then_holds():
    """Catches a warmup that starts late or early, or never ends: the lr of each step, read
    from the update of a unit gradient, is lr * t / (warmup_epochs * steps per epoch)."""
    config = TrainConfig(lr=0.4, warmup_epochs=0.5, batch_size=100, train_examples=1000)
    tx = assembly.optimizer(config)  # 10 steps an epoch: 5 of warmup.
    params = {"w": np.zeros(1, np.float32)}
    state, lrs = tx.init(params), []
    for _ in range(8):
        updates, state = tx.update({"w": np.ones(1, np.float32)}, state, params)
        lrs.append(-float(updates["w"][0]))
    np.testing.assert_allclose(lrs, [0.0, 0.08, 0.16, 0.24, 0.32, 0.4, 0.4, 0.4], rtol=1e-6)


def test_evaluation_never_counts_a_padded_row_as_correct():
    """Padded rows carry label 0: a model that always predicts 0 gets exactly the real rows
    whose label is 0 right, not the padding too (13 examples padded to 16 on 4 devices)."""
    zero = Model(lambda key: ({"b": np.zeros(10, np.float32)}, {}),
                        lambda params, state, x, mask, *, train, axis_name: (
                            jax.numpy.zeros((x.shape[0], 10)).at[:, 0].set(1.0) + params["b"],
                            state))
    program = assembly.build(zero, optax.sgd(0.1), "pmap", get_devices(4))
    state = program.backend.replicate(step_lib.init_state(zero, optax.sgd(0.1), jax.random.key(0)))
    labels = np.array([0, 1, 0, 2, 3, 0, 4, 5, 6, 7, 8, 9, 1], np.int32)
    split = data.Split(np.zeros((13, 28, 28, 1), np.float32), labels)
    totals = train.evaluate(program, state, split, batch_size=16)
    assert totals["count"] == 13 and totals["correct"] == 3


def test_off_a_terminal_each_step_logs_its_time_rate_running_loss_and_etas(tmp_path):
    """log_every 0: a line after every step, UTC-stamped; an epoch's last line carries the
    epoch's training loss and accuracy as the history has them. The TensorBoard events, read
    back with TensorBoard's own reader, hold the same values every scalars_every steps, the lr
    schedule and the config."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rng = np.random.default_rng(0)
    split = data.Split(rng.random((64, 28, 28, 1), np.float32), rng.integers(0, 10, 64).astype(np.int32))
    config = TrainConfig(devices=2, batch_size=16, epochs=2, train_examples=64, test_examples=16,
                         warmup_epochs=1.0)
    lines = []
    run = train.train(config, split, data.Split(split.images[:16], split.labels[:16]),
                      RunOptions(log_every=0.0, logdir=str(tmp_path), scalars_every=2,
                                 profile=(2, 4)),
                      log=lines.append)
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    for name in ("train_loss", "train_acc", "test_acc", "time_s"):
        assert scalars[f"epoch/{name}"] == [(4 * (i + 1), np.float32(e[name])) for i, e in enumerate(run["epochs"])]
    assert [s for s, _ in scalars["train/loss"]] == [2, 4, 6, 8]
    assert [scalars["train/loss"][i][1] for i in (1, 3)] == [np.float32(e["train_loss"]) for e in run["epochs"]]
    assert [v for _, v in scalars["train/lr"]] == pytest.approx([0.2 * min(s / 4, 1) for s in (2, 4, 6, 8)])
    assert "config/text_summary" in events.Tags()["tensors"]
    (trace,) = tmp_path.glob("plugins/profile/*/*.xplane.pb")  # Steps 3 and 4, a trace of them.
    assert b"train_step" in trace.read_bytes()
    logged = [m for m in map(LINE.fullmatch, lines) if m]
    assert [(int(m["epoch"]), int(m["step"])) for m in logged] == [(e, s) for e in (1, 2) for s in range(1, 5)]
    for m in logged:
        datetime.datetime.strptime(m["stamp"], "%Y-%m-%dT%H:%M:%SZ")
        assert float(m["rate"]) > 0
    for m, e in zip((logged[3], logged[7]), run["epochs"]):
        assert (m["loss"], m["acc"]) == (f"{e['train_loss']:.4f}", f"{e['train_acc']:.3f}")


LINE = re.compile(r"(?P<stamp>\S+) epoch (?P<epoch>\d+)/2 step (?P<step>\d+)/4: (?P<rate>[\d.]+) "
                  r"images/s, loss (?P<loss>[\d.]+), train acc (?P<acc>[\d.]+), epoch ETA "
                  r"\d+s, run ETA \d+s")


def test_lines_come_at_most_every_log_every_seconds():
    """Started at 0 s, steps at 1, 2, ..., 10 s, a line at most every 3 s: at 3, 6 and 9 s."""
    now = iter(range(11))
    lines = []
    p = progress.Progress(lines.append, epochs=1, per_epoch=10, global_batch=8, bar=False,
                          log_every_s=3.0, clock=lambda: float(next(now)))
    with p.epoch(0, 0):
        for step in range(1, 11):
            p.stepped(0, step, 1, lambda: (1.0, 0.5))
    assert [line.split()[4] for line in lines] == ["3/10:", "6/10:", "9/10:"]
    assert lines[0].endswith("8.0 images/s, loss 1.0000, train acc 0.500, epoch ETA 7s, run ETA 7s")
