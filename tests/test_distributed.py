"""Several processes, one run: 2 processes x 2 CPU devices train like 1 process x 4."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.measure import parity
from helpers import latest_checkpoint

FLAGS = ["--devices", "4", "--train-examples", "640", "--test-examples", "200", "--epochs", "2",
         "--batch-size", "64", "--no-progress"]


def final_state(directory):
    """Params and optimizer state of the run's last checkpoint."""
    (run_dir,) = Path(directory).glob("*dev-*")
    step, arrays, _ = latest_checkpoint(run_dir)
    return step, arrays["state"]


def lenet(*flags, processes=None):
    command = [sys.executable, "-m", "experiments.lenet", *FLAGS, *flags]
    if processes:
        command = [sys.executable, "-m", "experiments.launch", "--processes", str(processes), "--", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("backend", ["pmap", "jit"])
def test_two_processes_train_like_one_process_with_as_many_devices(tmp_path, backend):
    # The two processes also run 3 steps per call: each gathers its rows from its own copy.
    two = lenet("--backend", backend, "--checkpoint-dir", str(tmp_path / "two"),
                "--json", str(tmp_path / "two.json"), "--steps-per-call", "3", processes=2)
    assert two.returncode == 0, two.stderr
    one = lenet("--backend", backend, "--checkpoint-dir", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    assert two.stdout.count("epoch 1, time") == 1  # Process 0 alone prints ...
    assert json.loads((tmp_path / "two.json").read_text())["runs"][0]["config"]["devices"] == 4  # ... and writes.
    (step_two, two_state), (step_one, one_state) = final_state(tmp_path / "two"), final_state(tmp_path / "one")
    assert step_two == step_one == 2 * 10
    # The same per-device work; only the cross-process sum (gloo) adds in another order.
    assert parity.max_rel_diff(two_state, one_state) <= 1e-6


def test_a_resnet_as_two_processes_trains_like_one_process(tmp_path):
    """Catches BatchNorm statistics or gradients summed within each process only: the two
    processes' params and statistics after 2 steps are one process's, bit for bit (a narrow,
    one-block ResNet of ResNet-18's code: tests/tiny_resnet.py)."""
    def run(name, processes):
        command = [sys.executable, "-m", "experiments.train", "--model", "tests.tiny_resnet",
                   "--devices", "2", "--batch-size", "8",
                   "--lr", "0.1", "--epochs", "1", "--train-examples", "16", "--test-examples", "8",
                   "--steps-per-call", "2", "--no-progress", "--checkpoint-dir", str(tmp_path / name)]
        if processes:
            command = [sys.executable, "-m", "experiments.launch", "--processes", "2", "--", *command]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        assert "on 2 device(s)" in proc.stdout
        return final_state(tmp_path / name)

    (step_two, two_state), (step_one, one_state) = run("two", 2), run("one", None)
    assert step_two == step_one == 2
    # Each process holds one of the 2 devices: every sum across them has two terms, which
    # IEEE addition adds to the same bits in either order.
    assert parity.max_rel_diff(two_state, one_state) == 0


def test_the_launcher_stops_every_rank_and_passes_on_a_failure():
    proc = subprocess.run([sys.executable, "-m", "experiments.launch", "--processes", "2", "--",
                           sys.executable, "-c",
                           "import os, sys, time; r = int(os.environ['JAX_PROCESS_ID']); "
                           "sys.exit(3) if r == 1 else time.sleep(600)"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3


def test_a_device_count_that_does_not_split_over_the_processes_is_refused():
    proc = lenet("--devices", "3", processes=2)
    assert proc.returncode == 2
    assert "--devices 3 does not split over 2 processes" in proc.stderr
