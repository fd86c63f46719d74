"""The command line off the happy path: every bad value, signal or second run is one line on
stderr with its exit code, and leaves no half-written file."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import forked_commands

S = ["--devices", "2", "--train-examples", "512", "--test-examples", "256", "--batch-size", "64",
     "--no-progress"]
ENV = {**os.environ, "JAX_DP_NO_TCMALLOC": "1"}


def lenet(*flags, timeout=300):
    return subprocess.run([sys.executable, "-m", "experiments.lenet", *S, *flags],
                          capture_output=True, text=True, timeout=timeout, env=ENV)


def lenets(*runs):
    """Each run's flags (after S) to `python -m experiments.lenet`, in order, from one
    interpreter (tests/forked.py)."""
    return forked_commands(tuple(("experiments.lenet", *S, *flags) for flags in runs), ENV)


def start(*flags):
    return subprocess.Popen([sys.executable, "-m", "experiments.lenet", *S, *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, "PYTHONUNBUFFERED": "1"})


def one_line(proc, code, message):
    assert proc.returncode == code, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr, proc.stderr


BAD_VALUES = [
    (["--seed", str(2**63)], f"--seed must be a 64-bit integer (-2**63 to 2**63 - 1), got {2**63}"),
    (["--step-timeout", "-1"], "--step-timeout must be a positive number of seconds up to 2147483647, got -1.0"),
    (["--step-timeout", "nan"], "--step-timeout must be a positive number of seconds up to 2147483647, got nan"),
    (["--step-timeout", "0"], "--step-timeout must be a positive number of seconds up to 2147483647, got 0.0"),
    (["--batch-size", "1000", "--drop-remainder"],
     "--batch-size 1000 is more than the 512 training examples (--train-examples): pass at most 512"),
    (["--batch-size", "64,100000", "--devices", "1,2"], "--batch-size 100000 is more than the 512"),
    (["--tfds-dir", "/etc/hostname"], "/etc/hostname is a file: pass a folder as --tfds-dir"),
    (["--num-processes", "0"], "--num-processes must be at least 1, got 0"),
    (["--heartbeat-timeout", "0"], "--heartbeat-timeout: must be an integer of at least 1, got '0'"),
    # Beyond what JAX's runtime takes (32-bit whole seconds), in one line naming the flag.
    (["--start-timeout", "inf"],
     "--start-timeout must be a positive number of seconds up to 2147483617, got inf"),
    (["--start-timeout", "1e300"],
     "--start-timeout must be a positive number of seconds up to 2147483617, got 1e+300"),
    (["--heartbeat-timeout", "99999999999999"],
     "--heartbeat-timeout must be a positive number of seconds up to 2147483647, got 99999999999999"),
    (["--step-timeout", "1e300"],
     "--step-timeout must be a positive number of seconds up to 2147483647, got 1e+300"),
    (["--coordinator", "bad", "--num-processes", "2", "--process-id", "0"],
     "--coordinator must be HOST:PORT (process 0's address and a free port, e.g. "
     "localhost:12345), got 'bad'"),
    (["--log-every", "inf"], "--log-every must be a finite number of seconds, 0 or more, got inf"),
    (["--profile", "5"], "--profile: must be START:STOP, global steps like 10:20, got '5'"),
    (["--scalars-every", "0"], "--scalars-every: must be an integer of at least 1, got '0'"),
    (["--profile", "2:1", "--logdir", "tb"], "--profile must be START:STOP, global steps with 0 "
                                            "<= START < STOP, and a logdir for the trace, got 2:1"),
    (["--checkpoint-dir", "/etc/hostname"], "cannot write checkpoints to /etc/hostname/bs64-lr0.2 "
                                            "(Not a directory): pass a writable --checkpoint-dir"),
]


@pytest.fixture(scope="module")
def bad_value_runs():
    """Every BAD_VALUES case, by its flags, run once (lenets)."""
    cases = [tuple(flags) for flags, _ in BAD_VALUES]
    return dict(zip(cases, lenets(*cases)))


@pytest.mark.parametrize("flags, message", BAD_VALUES)
def test_bad_values_are_one_line_before_training(flags, message, bad_value_runs):
    one_line(bad_value_runs[tuple(flags)], 2, message)


def test_a_diverging_run_is_one_line_naming_the_flag_to_lower():
    """A non-finite loss is not a bad value, yet its line names --lr as the command spells it."""
    (run,) = lenets(("--lr", "1e30", "--epochs", "1"))
    one_line(run, 2, "error: the loss became non-finite at epoch 1, step 2; training stopped "
                     "with the last good state (and checkpoint): if the loss was diverging, "
                     "lower --lr; otherwise look for a non-finite value in that step's data")


MEASUREMENT_COUNTS = [
    ("exact_cost", ["--steps", "0"], "--steps: must be an integer of at least 1, got '0'"),
    ("exact_cost", ["--rounds", "x"], "--rounds: must be an integer of at least 1, got 'x'"),
    ("exact_cost", ["--batch-size", "-5"], "--batch-size: must be an integer of at least 1, got '-5'"),
    ("conv_passes", ["--repeats", "0"], "--repeats: must be an integer of at least 1, got '0'"),
    ("conv_passes", ["--batch-size", "0"], "--batch-size: must be an integer of at least 1, got '0'"),
    ("conv_passes", ["--margin", "1"], "--margin: must be a number from 0 up to (not including) 1, "
                                       "got '1'"),
    ("conv_passes", ["--margin", "nan"], "--margin: must be a number from 0 up to"),
    ("compare", ["--batch-size", "0"], "--batch-size: must be an integer of at least 1, got '0'"),
    ("benchmark", ["--steps", "0"], "--steps: must be an integer of at least 1, got '0'"),
    ("launch", ["--processes", "0", "--", "true"], "--processes: must be an integer of at least 1"),
]


@pytest.fixture(scope="module")
def measurement_runs():
    """Every MEASUREMENT_COUNTS case, by command, run once in this process (tests/forked.py)."""
    cases = [(f"experiments.{cli}", *flags) for cli, flags, _ in MEASUREMENT_COUNTS]
    return dict(zip(cases, forked_commands(tuple(cases), ENV)))


@pytest.mark.parametrize("cli, flags, message", MEASUREMENT_COUNTS)
def test_a_measurement_cli_refuses_a_count_it_cannot_use_in_one_line(cli, flags, message,
                                                                      measurement_runs):
    """Zero is refused, not read as 'the default'."""
    one_line(measurement_runs[(f"experiments.{cli}", *flags)], 2, message)


def test_a_plot_format_matplotlib_cannot_write_is_refused_and_no_file_is_made(tmp_path):
    plot, folder, nowhere = lenets(
        ("--plot", str(tmp_path / "p.xyz"), "--json", str(tmp_path / "r.json")),
        ("--json", str(tmp_path)), ("--json", str(tmp_path / "no" / "r.json")))
    one_line(plot, 2, f"--plot {tmp_path / 'p.xyz'}: matplotlib cannot write .xyz files: use one of ")
    assert ".png" in plot.stderr and list(tmp_path.iterdir()) == []
    one_line(folder, 2, f"cannot write {tmp_path} (it is a folder)")
    one_line(nowhere, 2, f"(no folder {tmp_path / 'no'})")


def test_a_symlink_loop_and_outputs_among_the_runs_own_files_are_refused(tmp_path):
    """Catches a loop of links replaced by a regular file, and a --json written over the run's
    own lock (a second run on the folder then started beside the first) or its data."""
    (tmp_path / "a.json").symlink_to(tmp_path / "b.json")
    (tmp_path / "b.json").symlink_to(tmp_path / "a.json")
    ckpt = tmp_path / "ckpt"
    loop, lock, data = lenets(
        ("--json", str(tmp_path / "a.json")),
        ("--checkpoint-dir", str(ckpt), "--json", str(ckpt / "bs64-lr0.2" / ".lock")),
        ("--tfds-dir", str(tmp_path / "tfds"), "--plot", str(tmp_path / "tfds" / "fashion_mnist_idx"
                                                             / "1.0.0" / "plot.png")))
    one_line(loop, 2, f"cannot write {tmp_path / 'a.json'} (its symbolic links form a loop): pass "
                      "a file's path")
    one_line(lock, 2, f"--json {ckpt / 'bs64-lr0.2' / '.lock'} is in the checkpoint folder "
                      f"({ckpt / 'bs64-lr0.2'}), whose files the run manages: pass a path outside it")
    one_line(data, 2, "is in the prepared data")
    assert (tmp_path / "a.json").is_symlink() and (tmp_path / "b.json").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json"]


def test_a_logdir_that_cannot_hold_event_files_is_refused_and_nothing_is_made(tmp_path):
    """--logdir is a folder to make or write: a file or FIFO there, a loop of links, a link to
    nothing, a folder under a file, and the checkpoint folder itself are each one line, before
    any work."""
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    ckpt = tmp_path / "ckpt"
    made = sorted(p.name for p in tmp_path.iterdir())
    file, fifo, loop, under, inside, dangling = lenets(
        ("--logdir", str(tmp_path / "file")), ("--logdir", str(tmp_path / "fifo")),
        ("--logdir", str(tmp_path / "a")), ("--logdir", str(tmp_path / "file" / "tb")),
        ("--checkpoint-dir", str(ckpt), "--logdir", str(ckpt / "bs64-lr0.2" / "tb")),
        ("--logdir", str(tmp_path / "dangling")))
    for proc, path in ((file, "file"), (fifo, "fifo")):
        one_line(proc, 2, f"--logdir {tmp_path / path} is not a folder: pass a folder")
    one_line(loop, 2, f"--logdir {tmp_path / 'a'}: its symbolic links form a loop: pass a folder")
    one_line(under, 2, f"--logdir {tmp_path / 'file' / 'tb'} cannot be made ({tmp_path / 'file'} "
                       "is not a folder)")
    one_line(inside, 2, f"--logdir {ckpt / 'bs64-lr0.2' / 'tb'} is in the checkpoint folder")
    one_line(dangling, 2, f"--logdir {tmp_path / 'dangling'} is a link to {tmp_path / 'gone'}, "
                          "which does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == made


def test_a_fifo_output_gets_one_document_at_the_end_and_never_hangs_the_run(tmp_path):
    """Catches a FIFO written after every epoch (the second open waited forever for a reader
    that had read once) or one without a reader that blocks: `cat fifo > copy` reads the whole
    run's JSON once and the run exits 0; with no reader, the run ends in one line."""
    fifo, copy = tmp_path / "runs.fifo", tmp_path / "copy.json"
    os.mkfifo(fifo)
    reader = subprocess.Popen(f"cat {fifo} > {copy}", shell=True)  # Gone once it has read.
    read, unread = lenets(("--devices", "1", "--epochs", "2", "--json", str(fifo)),
                          ("--devices", "1", "--epochs", "1", "--json", str(fifo)))
    assert read.returncode == 0, read.stderr
    reader.wait(timeout=30)
    assert [len(run["epochs"]) for run in json.loads(copy.read_text())["runs"]] == [2]
    one_line(unread, 2, f"cannot write {fifo} (a FIFO that no process reads)")


@pytest.mark.parametrize("signum, when", [(signal.SIGINT, "starting"), (signal.SIGTERM, "compiling"),
                                          (signal.SIGINT, "compiling")])
def test_a_signal_before_training_is_one_line_and_leaves_no_file(tmp_path, signum, when):
    """Catches a KeyboardInterrupt traceback, a crash at shutdown, or an empty --json left behind."""
    proc = start("--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"))
    if when == "starting":  # Importing JAX, or loading the data.
        time.sleep(1.0)
    else:  # The config line comes just before the step is compiled.
        while not proc.stdout.readline().startswith("config: "):
            assert proc.poll() is None, proc.communicate()
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err
    assert err == f"python -m experiments.lenet: interrupted ({signal.Signals(signum).name})\n"
    assert list(tmp_path.iterdir()) == []


def test_a_second_run_on_a_folder_is_refused_until_the_first_is_killed(tmp_path):
    """Two runs on one --checkpoint-dir: the second is refused at once naming the first's
    process; once the first is killed (SIGKILL: no chance to clean up), the folder is free."""
    flags = ["--checkpoint-dir", str(tmp_path), "--epochs", "500"]
    lock = tmp_path / "bs64-lr0.2" / ".lock"

    def holding(*extra):
        """A run started and seen holding the folder's lock."""
        proc = start(*flags, *extra)
        while not (lock.exists() and lock.read_text().strip() == str(proc.pid)):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        return proc

    first = holding()
    try:
        one_line(lenet(*flags), 2, f"{lock.parent} is in use by another run (process {first.pid}): "
                                   "wait for it to end, or pass another --checkpoint-dir")
    finally:
        first.kill()
        first.communicate()
    second = holding("--resume")  # The killed run's lock did not outlive it.
    second.kill()
    second.communicate()


def test_a_resume_of_other_values_is_refused_and_another_folder_starts_afresh(tmp_path):
    """Catches the silent restart: the folder holds the lr 0.2 run only."""
    first, other, afresh = lenets(
        ("--checkpoint-dir", str(tmp_path), "--epochs", "1"),
        ("--checkpoint-dir", str(tmp_path), "--epochs", "2", "--resume", "--lr", "0.3"),
        ("--checkpoint-dir", str(tmp_path / "new"), "--epochs", "1", "--resume", "--lr", "0.3"))
    assert first.returncode == 0, first.stderr
    one_line(other, 2,
             f"cannot resume: no run in {tmp_path} has this run's values; the nearest, "
             "bs64-lr0.2, was written with --lr 0.2, this run has --lr 0.3 (only a larger "
             "epochs may change): resume with the same values or use another --checkpoint-dir")
    assert afresh.returncode == 0 and "resuming" not in afresh.stdout, afresh.stderr
