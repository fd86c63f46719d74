"""Checkpoints off the happy path: damaged steps, a save cut short, a full disk, two runs on one
folder, and a resume whose folder holds only other runs."""

import dataclasses
import glob
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jax_dp import checkpoint, data, train
from jax_dp.config import RunOptions, TrainConfig
from jax_dp.errors import ParamError

rng = np.random.default_rng(0)
SPLIT = data.Split(rng.random((64, 28, 28, 1), np.float32), rng.integers(0, 10, 64).astype(np.int32))
RUN = TrainConfig(devices=2, batch_size=16, epochs=2, train_examples=64, test_examples=64)
LAST = 8  # RUN's global steps: 2 epochs of 4.


def quiet(_):
    pass


@pytest.fixture(scope="module")
def straight():
    """RUN's result, never interrupted."""
    return train.train(RUN, SPLIT, SPLIT, log=quiet)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A folder of RUN checkpointed every step: steps 7 and 8 are kept."""
    directory = tmp_path_factory.mktemp("saved")
    train.train(RUN, SPLIT, SPLIT,
                RunOptions(checkpoint_dir=str(directory), checkpoint_every=1), log=quiet)
    assert sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) == [LAST - 1, LAST]
    return directory


def copy_of(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "run")
    return tmp_path / "run"


def truncate_data(step_dir):
    for path in glob.glob(f"{step_dir}/arrays/**/d/*", recursive=True):
        open(path, "w").close()


# Each damage as a user met it, done to the newest step's folder.
DAMAGES = {
    "metadata removed": lambda d: (d / "meta" / "metadata").unlink(),
    "metadata garbage": lambda d: (d / "meta" / "metadata").write_text("{not json"),
    "arrays removed": lambda d: shutil.rmtree(d / "arrays"),
    "data files emptied": truncate_data,
    "manifest removed": lambda d: (d / "arrays" / "manifest.ocdbt").unlink(),
}


def resumed(directory):
    lines = []
    run = train.train(RUN, SPLIT, SPLIT,
                      RunOptions(checkpoint_dir=str(directory), resume=True), log=lines.append)
    return run, lines


def assert_same_run(a, b):
    for x, y in zip(jax.tree.leaves(a["state"]), jax.tree.leaves(b["state"]), strict=True):
        np.testing.assert_array_equal(x, y)
    assert [{k: v for k, v in e.items() if k != "time_s"} for e in a["epochs"]] == \
        [{k: v for k, v in e.items() if k != "time_s"} for e in b["epochs"]]


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_newest_step_is_reported_kept_and_the_run_resumes_from_the_one_before(
        saved, tmp_path, straight, damage):
    """Catches a traceback, a silent restart, or a damaged step deleted: the run says which
    step is damaged and why, keeps it aside, and resumes from step 7 to the straight run."""
    directory = copy_of(saved, tmp_path)
    DAMAGES[damage](directory / str(LAST))
    run, lines = resumed(directory)
    assert lines[1].startswith(f"checkpoint step {LAST} is damaged (")
    assert lines[1].endswith(f"): kept as {directory / f'{LAST}.damaged'}, resuming from step {LAST - 1}")
    assert lines[2].startswith(f"resuming from {directory} at epoch 2, step 3")
    assert (directory / f"{LAST}.damaged").is_dir()
    assert_same_run(run, straight)
    again = resumed(directory)[1]  # Step 8, saved anew, is read back.
    assert again[1] == f"resuming from {directory} at epoch 3, step 0"


def test_of_many_steps_the_resume_takes_the_newest_intact_one(tmp_path, straight, monkeypatch):
    """Catches a fallback to the oldest intact step, or to any but the newest: of steps 1-8, 8 and
    7 damaged, the run resumes from 6 (not 1) and ends as the straight run."""
    real = checkpoint._manager
    monkeypatch.setattr(checkpoint, "_manager", lambda directory, keep: real(directory, None))
    train.train(RUN, SPLIT, SPLIT, RunOptions(checkpoint_dir=str(tmp_path), checkpoint_every=1),
                log=quiet)
    monkeypatch.undo()
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == list(range(1, 9))
    DAMAGES["manifest removed"](tmp_path / str(LAST))
    DAMAGES["metadata removed"](tmp_path / str(LAST - 1))
    run, lines = resumed(tmp_path)
    assert lines[1].endswith(f"resuming from step {LAST - 2}") and lines[2].endswith(
        f"resuming from step {LAST - 2}")
    assert lines[3] == f"resuming from {tmp_path} at epoch 2, step 2"
    assert_same_run(run, straight)


def test_with_no_intact_step_the_resume_is_refused_in_one_line_and_nothing_moves(saved, tmp_path):
    directory = copy_of(saved, tmp_path)
    DAMAGES["manifest removed"](directory / str(LAST))
    DAMAGES["metadata removed"](directory / str(LAST - 1))
    with pytest.raises(ParamError) as e:
        resumed(directory)
    message = str(e.value)
    assert message.startswith(f"no intact checkpoint in {directory}: step {LAST} is damaged (ValueError: ")
    assert f"; step {LAST - 1} is damaged (FileNotFoundError: " in message and "\n" not in message
    assert message.endswith(": pass another checkpoint_dir or remove this one to start again")
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) == \
        [str(LAST - 1), str(LAST)]


def test_a_save_cut_short_by_a_kill_is_passed_over(saved, tmp_path, straight):
    """A kill during a save leaves Orbax's temporary folder: the resume goes on from the last
    finished save and later saves the same step over it."""
    directory = copy_of(saved, tmp_path)
    (directory / str(LAST)).rename(directory / f"{LAST}.orbax-checkpoint-tmp-1234")
    truncate_data(directory / f"{LAST}.orbax-checkpoint-tmp-1234")
    run, lines = resumed(directory)
    assert lines[1].startswith(f"resuming from {directory} at epoch 2, step 3")
    assert_same_run(run, straight)


def test_a_full_disk_is_one_line_naming_the_folder(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise ValueError("RESOURCE_EXHAUSTED: Failed writing: No space left on device [os_error_code='28']")
    monkeypatch.setattr(ocp.CheckpointManager, "save", full)
    with pytest.raises(ParamError) as e:
        train.train(RUN, SPLIT, SPLIT,
                    RunOptions(checkpoint_dir=str(tmp_path), checkpoint_every=1), log=quiet)
    assert str(e.value) == (
        f"cannot save a checkpoint in {tmp_path} (ValueError: RESOURCE_EXHAUSTED: Failed writing: No "
        "space left on device [os_error_code='28']): free some space, or pass another checkpoint_dir")


def test_a_folder_in_use_is_refused_naming_the_holder_and_freed_when_it_ends(tmp_path):
    holder = checkpoint._lock(tmp_path)
    with pytest.raises(ParamError, match=rf"{tmp_path} is in use by another run \(process "
                                         rf"{os.getpid()}\): wait for it to end, or pass another "):
        train.train(RUN, SPLIT, SPLIT, RunOptions(checkpoint_dir=str(tmp_path)), log=quiet)
    holder.close()
    train.train(dataclasses.replace(RUN, epochs=1), SPLIT, SPLIT,
                RunOptions(checkpoint_dir=str(tmp_path)), log=quiet)
    checkpoint._lock(tmp_path).close()  # A run that ended leaves the folder free ...
    with pytest.raises(ParamError, match="cannot resume"):
        train.train(dataclasses.replace(RUN, lr=0.3), SPLIT, SPLIT,
                    RunOptions(checkpoint_dir=str(tmp_path), resume=True), log=quiet)
    checkpoint._lock(tmp_path).close()  # ... and so does one that failed.


def test_a_checkpoint_folder_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ParamError, match=rf"cannot write checkpoints to {tmp_path / 'f'}"):
        train.train(RUN, SPLIT, SPLIT, RunOptions(checkpoint_dir=str(tmp_path / "f")), log=quiet)


def test_a_resume_is_refused_when_the_folder_holds_only_other_runs(saved, tmp_path):
    """Catches a resume that silently starts over: the CLI names each run's folder by its
    global batch size and lr, so another value finds no folder of its own."""
    root = tmp_path / "root"
    shutil.copytree(saved, root / "bs16-lr0.2")
    other = [dataclasses.replace(RUN, lr=0.3, epochs=3)]
    with pytest.raises(ParamError) as e:
        checkpoint.check_resumable(root, other)
    assert str(e.value) == (
        f"cannot resume: no run in {root} has this run's values; the nearest, bs16-lr0.2, was "
        "written with lr 0.2, this run has lr 0.3 (only a larger epochs may change): resume with "
        "the same values or use another checkpoint_dir")
    assert e.value.params == ("lr", "lr", "checkpoint_dir")
    two = [dataclasses.replace(RUN, devices=1, batch_size=8, epochs=3)]
    with pytest.raises(ParamError, match="written with batch_size 16, this run has batch_size 8"):
        checkpoint.check_resumable(root, two)
    # Another device count and backend are the same run, placed elsewhere.
    checkpoint.check_resumable(root, [dataclasses.replace(RUN, devices=1, backend="single", epochs=3)])
    # A run of this invocation is there: the others start afresh, as when first run.
    checkpoint.check_resumable(root, [*other, dataclasses.replace(RUN, epochs=3)])
    checkpoint.check_resumable(tmp_path / "empty", other)
