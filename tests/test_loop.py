"""Many steps per compiled call (jax_dp.loop): the same batches and, bit for bit, the same run."""

import dataclasses
import os
import signal

import jax
import numpy as np
import pytest

from jax_dp import checkpoint, data, feeds, progress, train
from jax_dp.config import RunOptions, TrainConfig
from jax_dp.errors import ParamError

# 100 examples in batches of 16: 7 steps an epoch, the last padded; calls of 3 steps: 3, 3, 1.
N, BATCH, PER_CALL = 100, 16, 3
SPLIT = data.Split(np.random.default_rng(0).random((N, 28, 28, 1), np.float32),
                   np.random.default_rng(1).integers(0, 10, N).astype(np.int32))
RUN = TrainConfig(devices=2, batch_size=BATCH, epochs=2, train_examples=N, test_examples=N)


def quiet(_):
    pass


def assert_bitwise_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("devices,start,drop", [(1, 0, False), (3, 0, False), (2, 2, False),
                                                (4, 1, True)])
def test_calls_gather_exactly_the_batches_data_batches_gives(devices, start, drop):
    """Catches a call that skips, repeats or misorders an example, or pads unlike the host."""
    order = np.random.default_rng(2).permutation(N)
    where = dict(pad_to=devices, order=order, start=start, drop_remainder=drop)
    want = list(data.batches(SPLIT, BATCH, **where))
    split = feeds.on_device(SPLIT)
    got = [{"image": split["image"][index], "label": split["label"][index], "mask": mask}
           for call in feeds.calls(N, BATCH, PER_CALL, **where)
           for index, mask in zip(call["index"].T, call["mask"].T)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for name in w:
            np.testing.assert_array_equal(g[name], w[name])


@pytest.fixture(scope="module")
def one_step_per_call():
    return {backend: train.train(dataclasses.replace(RUN, backend=backend, devices=k), SPLIT,
                                 SPLIT, log=quiet)
            for backend, k in (("pmap", 2), ("shard_map", 2), ("jit", 2), ("single", 1))}


@pytest.mark.parametrize("backend,k", [("pmap", 2), ("shard_map", 2), ("jit", 2), ("single", 1)])
def test_n_steps_per_call_equal_n_calls_of_one_step_bit_for_bit(one_step_per_call, backend, k):
    """Catches a scanned step that differs from the step in any bit of the params, BatchNorm
    or optimizer state, on any backend, over two epochs with a padded last batch and a last
    call shorter than the others.

    The reported train loss is the one exception: no update depends on its value, and XLA:CPU
    compiles the loss differently inside a loop under pmap (a step's loss sum moved by 1e-7,
    measured), so it agrees to float32 round-off; counts and accuracies are exact."""
    many = train.train(dataclasses.replace(RUN, backend=backend, devices=k), SPLIT, SPLIT,
                       RunOptions(steps_per_call=PER_CALL), log=quiet)
    single = one_step_per_call[backend]
    assert_bitwise_equal(many["state"], single["state"])
    for a, b in zip(many["epochs"], single["epochs"], strict=True):
        assert (a["train_acc"], a["test_acc"]) == (b["train_acc"], b["test_acc"])
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)


def test_resnet_steps_per_call_equal_single_steps_bit_for_bit():
    """The same with BatchNorm's running statistics carried through the scan (ResNet-18's code,
    narrow: tests/tiny_resnet.py)."""
    config = TrainConfig(model="tests.tiny_resnet", devices=2, batch_size=8, epochs=1, train_examples=20,
                         test_examples=8)
    split = data.Split(SPLIT.images[:20], SPLIT.labels[:20])
    test = data.Split(SPLIT.images[:8], SPLIT.labels[:8])
    runs = [train.train(config, split, test,
                        RunOptions(steps_per_call=n), log=quiet)["state"] for n in (1, 2)]
    assert_bitwise_equal(*runs)


@pytest.mark.parametrize("resumed_per_call", [1, 5])
def test_a_run_stopped_between_calls_resumes_with_any_steps_per_call_bit_for_bit(
        tmp_path, monkeypatch, one_step_per_call, resumed_per_call):
    """Catches saves not at the first call end at or past each multiple of checkpoint_every,
    and a resume mid-epoch that loses or repeats a step, with one step per call or with 5
    (from step 3 of 7 that is a call of 4 steps, a length no full epoch has)."""
    saved, real_save = [], checkpoint.Checkpointer.save
    monkeypatch.setattr(checkpoint.Checkpointer, "save", lambda self, state, metrics, position: (
        saved.append(position.global_step), real_save(self, state, metrics, position))[1])

    def on_step(position):  # SIGTERM once the run's fourth call (epoch 2, steps 1-3) is done.
        if position.global_step == 10:
            os.kill(os.getpid(), signal.SIGTERM)

    options = RunOptions(checkpoint_dir=str(tmp_path), checkpoint_every=4)
    with pytest.raises(train.Interrupted, match="epoch 2, step 3"):
        train.train(RUN, SPLIT, SPLIT, dataclasses.replace(options, steps_per_call=PER_CALL),
                    log=quiet, on_step=on_step)
    # Calls end at steps 3, 6, 7 (epoch 1's end), 10 (the signal): 6 is the first past 4,
    # 7 the epoch's end, 10 the first past 8 and where the signal stops the run.
    assert saved == [6, 7, 10]
    monkeypatch.undo()
    lines = []
    resumed = train.train(RUN, SPLIT, SPLIT, dataclasses.replace(
        options, resume=True, steps_per_call=resumed_per_call), log=lines.append)
    assert any(line.endswith("at epoch 2, step 3") for line in lines)
    assert_bitwise_equal(resumed["state"], one_step_per_call["pmap"]["state"])


def test_a_non_finite_step_inside_a_call_is_named_as_with_one_step_per_call():
    """Catches a guard that reports the call instead of the step, or misses a bad step."""
    config = dataclasses.replace(RUN, lr=1e30)
    messages = []
    for n in (1, PER_CALL):
        with pytest.raises(train.NonFiniteError) as error:
            train.train(config, SPLIT, SPLIT, RunOptions(steps_per_call=n), log=quiet)
        messages.append(str(error.value))
    assert messages[0] == messages[1]
    assert messages[0].startswith("the loss became non-finite at epoch 1, step")


def test_steps_per_call_below_one_is_refused():
    with pytest.raises(ParamError, match="steps_per_call must be at least 1, got 0"):
        RunOptions(steps_per_call=0)


def test_the_progress_bar_counts_every_step_of_every_call(monkeypatch):
    """Catches a bar that counts calls instead of steps (it would end at 3 of 7)."""
    bars = []

    class Bar:
        def __init__(self, total, initial, **_):
            self.total, self.count = total, initial
            bars.append(self)

        disable = False  # Shown, as on a terminal.

        def update(self, n=1):
            self.count += n

        def set_postfix_str(self, *_, **__):
            pass

        def close(self):
            pass

    monkeypatch.setattr(progress.tqdm, "tqdm", Bar)
    train.train(RUN, SPLIT, SPLIT, RunOptions(steps_per_call=PER_CALL, progress=True), log=quiet)
    assert [(b.total, b.count) for b in bars] == [(7, 7), (7, 7)]
