"""The cluster managers users start runs with, on real local installations: Open MPI's mpirun
and a one-node SLURM cluster (tests/clusters/start_slurm.sh), each found by JAX's own detection."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from test_distributed import final_state

FLAGS = ["--devices", "2", "--train-examples", "256", "--test-examples", "64", "--epochs", "4",
         "--batch-size", "64", "--no-progress", "--steps-per-call", "1"]
START_SLURM = Path(__file__).parent / "clusters" / "start_slurm.sh"


def slurm_env() -> dict:
    """The environment srun needs, with the local cluster started; skips (saying why) where
    Debian's slurm-wlm or root is missing."""
    if shutil.which("srun") is None or not os.path.exists("/usr/sbin/slurmctld"):
        pytest.skip("SLURM is not installed (make setup installs Debian's slurm-wlm)")
    if os.geteuid() != 0:
        pytest.skip("starting a local SLURM cluster needs root")
    conf = subprocess.run([str(START_SLURM)], capture_output=True, text=True, timeout=120)
    assert conf.returncode == 0, conf.stderr
    return {**os.environ, "SLURM_CONF": conf.stdout.strip()}


def task_pid(checkpoint_dir: Path, rank: int) -> int:
    """The pid of SLURM's task rank in the run writing to checkpoint_dir."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                command = (proc / "cmdline").read_bytes()
                environ = (proc / "environ").read_bytes().split(b"\0")
            except OSError:
                continue  # Gone meanwhile.
            if str(checkpoint_dir).encode() in command and b"experiments.lenet" in command \
                    and f"SLURM_PROCID={rank}".encode() in environ:
                return int(proc.name)
        time.sleep(0.1)
    raise TimeoutError(f"task {rank} did not start")


def test_srun_and_mpirun_each_start_one_run_the_launchers_and_srun_resumes_a_killed_one(tmp_path):
    """srun -n 2 and mpirun -n 2: one run of 2 processes, its lines printed and its JSON written
    once, the launcher's history and state bit for bit (copies printed every line twice). A
    task killed mid-run ends the job step with one line naming it, exit 3; --resume under a new
    srun finishes the run with the uninterrupted one's bits."""
    if shutil.which("mpirun") is None:
        pytest.skip("Open MPI's mpirun is not installed (make setup installs Debian's openmpi-bin)")
    env = slurm_env()

    def command(name, *extra):
        return [sys.executable, "-m", "experiments.lenet", *FLAGS, *extra,
                "--json", str(tmp_path / f"{name}.json"), "--checkpoint-dir", str(tmp_path / name)]

    def run(name, *start, extra=()):
        proc = subprocess.run([*start, *command(name, *extra)], capture_output=True, text=True,
                              timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.count("epoch 1, time") <= 1 and "test acc:" in proc.stdout, proc.stdout
        (one,) = json.loads((tmp_path / f"{name}.json").read_text())["runs"]
        return [{k: v for k, v in e.items() if k != "time_s"} for e in one["epochs"]], \
            final_state(tmp_path / name)

    def same(a, b):
        return a[0] == b[0] and a[1][0] == b[1][0] == 16 and all(
            np.asarray(x).tobytes() == np.asarray(y).tobytes()
            for x, y in zip(jax.tree.leaves(a[1][1]), jax.tree.leaves(b[1][1])))

    launched = run("launched", sys.executable, "-m", "experiments.launch", "--processes", "2", "--")
    # mpirun binds each process to a core by default: XLA then runs one thread, other round-off.
    assert same(run("mpi", "mpirun", "--allow-run-as-root", "--bind-to", "none", "-n", "2"), launched)
    srun = ["srun", "-n", "2", "--overcommit", "--kill-on-bad-exit"]
    assert same(run("srun", *srun), launched)

    step = subprocess.Popen([*srun, *command("killed", "--checkpoint-every", "1")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    victim = task_pid(tmp_path / "killed", 1)
    ckpt = tmp_path / "killed" / "bs64-lr0.2"
    while not (ckpt.is_dir() and any(p.name.isdigit() and int(p.name) > 5 for p in ckpt.iterdir())):
        assert step.poll() is None, step.communicate()
        time.sleep(0.02)
    os.kill(victim, signal.SIGKILL)
    _, err = step.communicate(timeout=120)
    # SLURM's own lines aside (srun's, and slurmstepd's when it cancels the step).
    ours = [line for line in err.splitlines() if not line.startswith(("srun: ", "slurmstepd"))]
    newest = max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    assert len(ours) == 1 and ours[0].startswith(
        "python -m experiments.lenet: error: process 1 of the run was lost ("), err
    assert ours[0].endswith(f"the newest checkpoint is step {newest} in {ckpt}: resume with "
                            "--resume on the processes that remain"), err
    assert step.returncode != 0 and "task 0: Exited with exit code 3" in err, err
    assert 5 < newest < 16
    resumed = run("killed", *srun, extra=("--resume",))
    assert same(resumed, launched)
