"""A run stopped on k devices resumes on k': the exact mode's bits, the normal mode's round-off."""

import dataclasses
import os
import signal
from pathlib import Path

import jax
import numpy as np
import pytest

from experiments import runs
from jax_dp import assembly, data, train
from jax_dp.config import RunOptions, TrainConfig
from jax_dp.errors import ParamError

# Each of 1, 2, 4 and 8 devices, moves up and down, the backend alternating: 6 parts, the
# fifth stopped at the first epoch's end.
EVERY_COUNT = (1, 2, 8, 4, 1, 2)
UP_AND_DOWN = (1, 8, 2)


def bits(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def untimed(run: dict) -> list[dict]:
    return [{k: v for k, v in e.items() if k != "time_s"} for e in run["epochs"]]


def stop_at(global_step: int):
    """An on_step that asks the run to stop (as SIGTERM does) once it reaches global_step."""
    def on_step(position):
        if position.global_step == global_step:
            os.kill(os.getpid(), signal.SIGTERM)
    return on_step


def in_segments(config: TrainConfig, split: data.Split, directory: Path, devices, backends):
    """config run in len(devices) parts, part i on devices[i] devices under backends[i], each
    stopped one step after the last and resumed from its checkpoint by the next."""
    options = RunOptions(checkpoint_dir=str(directory), resume=True, steps_per_call=1)
    per_epoch = assembly.steps_per_epoch(config)
    for i, (k, backend) in enumerate(zip(devices, backends)):
        part = dataclasses.replace(config, devices=k, backend=backend)
        last, lines = i == len(devices) - 1, []
        try:
            run = train.train(part, split, split, options, log=lines.append,
                              on_step=(lambda p: None) if last else stop_at(i + 1))
        except train.Interrupted:
            assert not last
        else:
            assert last, f"part {i} ran to the end"
        if i:  # Each part goes on from where the one before stopped.
            assert (f"resuming from {directory} at epoch {i // per_epoch + 1}, step "
                    f"{i % per_epoch}") in lines
    return run


def split_of(images: data.Split, n: int) -> data.Split:
    return data.Split(images.images[:n], images.labels[:n])


@pytest.mark.parametrize("model, devices", [("lenet", EVERY_COUNT),
                                            ("tests.tiny_resnet", UP_AND_DOWN)])
def test_an_exact_run_resumed_on_other_device_counts_and_backends_keeps_its_bits(
        tmp_path, fashion_train_6k, model, devices):
    """Stopped after every step and resumed on another device count and backend: params,
    BatchNorm statistics, optimizer state and history are the uninterrupted run's bits.
    5 steps an epoch, the last one padded (76 examples): stops fall mid-epoch and on an
    epoch's last step; the evaluation's last batch is padded too."""
    split = split_of(fashion_train_6k, 76)
    config = TrainConfig(model=model, exact=True, batch_size=16, lr=0.1, epochs=3,
                         train_examples=76, test_examples=76)
    whole = train.train(config, split, split, RunOptions(steps_per_call=1), log=lambda _: None)
    backends = ["pmap", "shard_map"] * len(devices)
    parts = in_segments(config, split, tmp_path, devices, backends)
    assert untimed(parts) == untimed(whole) and len(untimed(whole)) == 3
    assert bits(parts["state"]) == bits(whole["state"])


def test_a_normal_run_resumed_on_other_device_counts_stays_within_round_off(tmp_path,
                                                                            fashion_train_6k):
    """Without the exact mode psum's order follows k, so the resumed run moves by round-off:
    within 1e-6 of the params' largest value (measured: 6e-8) and 1e-3 in loss after 12 steps."""
    split = split_of(fashion_train_6k, 512)
    config = TrainConfig(devices=4, batch_size=128, lr=0.2, epochs=3, train_examples=512,
                         test_examples=512)
    whole = train.train(config, split, split, RunOptions(steps_per_call=1), log=lambda _: None)
    parts = in_segments(config, split, tmp_path, (4, 2, 1, 8), ("pmap", "shard_map", "single", "jit"))
    got, want = jax.tree.leaves(parts["state"].params), jax.tree.leaves(whole["state"].params)
    scale = max(float(np.abs(w).max()) for w in want)
    worst = max(float(np.abs(g - w).max()) for g, w in zip(got, want))
    assert 0 < worst <= 1e-6 * scale  # Not bitwise (psum's order), but round-off.
    for a, b in zip(untimed(parts), untimed(whole)):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-3)
        assert a["test_acc"] == pytest.approx(b["test_acc"], abs=2 / 512)


def test_per_device_statistics_keep_their_device_count(tmp_path, fashion_train_6k):
    """bn local: each device normalises by its own shard, so the device count is part of the
    run; a resume on another is refused in one line, on the same one it goes on."""
    split = split_of(fashion_train_6k, 64)
    config = TrainConfig(model="tests.tiny_resnet", options={"bn": "local"}, devices=2,
                         batch_size=32, epochs=2, train_examples=64, test_examples=64)
    options = RunOptions(checkpoint_dir=str(tmp_path), resume=True, steps_per_call=1)
    with pytest.raises(train.Interrupted):
        train.train(config, split, split, options, log=lambda _: None, on_step=stop_at(1))
    with pytest.raises(ParamError, match="cannot resume: the checkpoint in .* was written with "
                                         "devices 2, this run has devices 1"):
        train.train(dataclasses.replace(config, devices=1), split, split, options,
                    log=lambda _: None)
    assert train.train(config, split, split, options, log=lambda _: None)["epochs"]


def test_run_folders_are_named_by_global_batch_and_lr(tmp_path):
    """A resume on another device count finds the run; runs of one command that share batch
    and lr are told apart by order; a folder named by device count is nobody's."""
    configs = [TrainConfig(devices=k, batch_size=b, lr=0.2) for k, b in ((1, 64), (2, 64), (4, 32))]
    want = [str(tmp_path / "bs64-lr0.2"), str(tmp_path / "bs64-lr0.2-2"), str(tmp_path / "bs32-lr0.2")]
    assert runs.run_folders(str(tmp_path), configs) == want
    (tmp_path / "2dev-bs64-lr0.2").mkdir()
    assert runs.run_folders(str(tmp_path), configs) == want
