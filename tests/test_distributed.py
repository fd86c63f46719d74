"""Several processes, one run: 2 processes x 2 CPU devices train like 1 process x 4."""

import dataclasses
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from experiments.launch import cause, free_port, launch
from experiments.measure import divergence
from helpers import latest_checkpoint

FLAGS = ["--devices", "4", "--train-examples", "640", "--test-examples", "200", "--epochs", "2",
         "--batch-size", "64", "--no-progress"]


def final_state(directory):
    """Params and optimizer state of the run's last checkpoint."""
    (run_dir,) = Path(directory).glob("bs*")
    step, arrays, _ = latest_checkpoint(run_dir)
    return step, arrays["state"]


def lenet(*flags, processes=None):
    command = [sys.executable, "-m", "experiments.lenet", *FLAGS, *flags]
    if processes:
        command = [sys.executable, "-m", "experiments.launch", "--processes", str(processes), "--", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def test_two_processes_train_like_one_process_with_as_many_devices(tmp_path):
    """jit, 2 processes x 2 devices, against 1 process x 4 devices (pmap); pmap across processes
    is the ResNet's test below and the exact run's further down."""
    one = lenet("--checkpoint-dir", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    step_one, one_state = final_state(tmp_path / "one")
    for backend in ("jit",):
        # The two processes also run 3 steps per call: each gathers its rows from its own copy.
        two = lenet("--backend", backend, "--checkpoint-dir", str(tmp_path / backend),
                    "--json", str(tmp_path / f"{backend}.json"), "--steps-per-call", "3",
                    processes=2)
        assert two.returncode == 0, two.stderr
        assert two.stdout.count("epoch 1, time") == 1  # Process 0 alone prints ...
        runs = json.loads((tmp_path / f"{backend}.json").read_text())["runs"]
        assert runs[0]["config"]["devices"] == 4  # ... and writes.
        step_two, two_state = final_state(tmp_path / backend)
        assert step_two == step_one == 2 * 10
        # The same per-device work; only the cross-process sum (gloo) adds in another order.
        assert divergence.max_rel_diff(two_state, one_state) <= 1e-6


def test_a_resnet_as_two_processes_trains_like_one_process(tmp_path):
    """Catches BatchNorm statistics or gradients summed within each process only: the two
    processes' params and statistics after 2 steps are one process's, bit for bit (a narrow,
    one-block ResNet of ResNet-18's code: tests/tiny_resnet.py)."""
    def run(name, processes):
        command = [sys.executable, "-m", "experiments.train", "--model", "tests.tiny_resnet",
                   "--devices", "2", "--batch-size", "8",
                   "--lr", "0.1", "--epochs", "1", "--train-examples", "16", "--test-examples", "8",
                   "--steps-per-call", "1", "--no-progress", "--checkpoint-dir", str(tmp_path / name)]
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
    assert divergence.max_rel_diff(two_state, one_state) == 0


@pytest.mark.parametrize("failure, code", [("sys.exit(3)", 3),
                                           ("os.kill(os.getpid(), signal.SIGKILL)", 128 + 9)])
def test_the_launcher_stops_every_rank_and_exits_as_a_shell_would(failure, code):
    """The failing rank's code passes on, a death by signal N as 128 + N (a SIGKILLed rank made
    the launcher exit 247, -9 passed to sys.exit)."""
    proc = subprocess.run([sys.executable, "-m", "experiments.launch", "--processes", "2", "--",
                           sys.executable, "-c",
                           "import os, signal, sys, time; r = int(os.environ['JAX_PROCESS_ID']); "
                           f"{failure} if r == 1 else time.sleep(600)"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == code


@pytest.mark.parametrize("failed, first", [([(0, 2), (1, -signal.SIGABRT)], (0, 2)),
                                           ([(0, 3), (1, -signal.SIGKILL)], (1, -signal.SIGKILL)),
                                           ([(0, -signal.SIGABRT), (1, 3)], (0, -signal.SIGABRT)),
                                           ([(0, 1), (1, 2)], (0, 1))])
def test_the_launcher_names_the_cause_not_its_aftermath(failed, first):
    """Seen in one poll, a rank that exited 3 (its peer lost) or was aborted by JAX's runtime (its
    peer vanished) is the aftermath of the other failure."""
    assert cause(failed) == first


def test_a_rank_deaf_to_sigterm_is_killed_after_the_grace_period(capsys):
    """The launcher's bound: one rank fails, the other ignores SIGTERM and is killed grace_s
    later; the launcher names the failed rank in one line."""
    ignore = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "sys.exit(3) if os.environ['JAX_PROCESS_ID'] == '1' else time.sleep(600)")
    started = time.monotonic()
    assert launch([sys.executable, "-c", ignore], 2, grace_s=2) == 3
    assert time.monotonic() - started < 30
    assert capsys.readouterr().err == ("python -m experiments.launch: process 1 ended (exit code "
                                       "3); stopping the others\n")


def test_a_device_count_that_does_not_split_over_the_processes_is_refused():
    proc = lenet("--devices", "3", processes=2)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "SIGABRT" not in proc.stderr
    assert "--devices 3 does not split over 2 processes" in proc.stderr


def rank(process_id, port, *flags, timeout="4", patch=None):
    """One rank of a 2-process run started by hand, as on two hosts (after the Python
    statements in patch, if given)."""
    start = ["-m", "experiments.lenet"] if patch is None else ["-c", (
        f"{patch}; import runpy, sys; sys.argv[0] = 'lenet'; "
        "runpy.run_module('experiments.lenet', run_name='__main__')")]
    return [sys.executable, *start, *FLAGS, "--coordinator", f"127.0.0.1:{port}",
            "--num-processes", "2", "--process-id", str(process_id), "--start-timeout", timeout,
            *flags]


@pytest.mark.parametrize("process_id", [0, 1])
def test_a_peer_or_coordinator_that_never_comes_ends_the_start_in_one_line(process_id):
    """Process 0 whose peer never starts, and process 1 whose coordinator never listens: JAX
    waited 300 s, then aborted in C++ with a stack trace."""
    port = free_port()
    start = time.monotonic()
    proc = subprocess.run(rank(process_id, port), capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 60
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == (f"python -m experiments.lenet: error: process {process_id} could not "
                           f"join the run at 127.0.0.1:{port} within 4 s: start all 2 processes "
                           "with the same --coordinator, or pass a longer --start-timeout\n")


def test_a_coordinator_port_in_use_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(rank(0, port), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr == (f"python -m experiments.lenet: error: cannot start the coordinator at "
                           f"127.0.0.1:{port} (Address already in use): pass a free port in "
                           "--coordinator\n")


def listening(port):
    """The local addresses (hex, as /proc/net/tcp* write them) that listen on port."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.append(address)
    return found


def test_the_coordinator_listens_on_loopback_only_and_a_signal_ends_the_wait():
    """JAX's coordinator listened on every interface (*:PORT), without authentication."""
    port = free_port()
    proc = subprocess.Popen(rank(0, port, timeout="120"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not listening(port) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        # 127.0.0.1 only (IPv4, or IPv4-mapped in IPv6's table): no 0.0.0.0, no [::].
        assert listening(port) and set(listening(port)) <= {"0100007F",
                                                             "0000000000000000FFFF00000100007F"}
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 143 and err == "python -m experiments.lenet: interrupted (SIGTERM)\n"


@pytest.mark.parametrize("flag, flags, values", [
    ("--devices", (["--devices", "2"], ["--devices", "4"]), ("2", "4")),
    ("--exact", ([], ["--exact"]), ("False", "True")),
    ("--checkpoint-every", (["--checkpoint-every", "5"], ["--checkpoint-every", "7"]), ("5", "7")),
    ("--steps-per-call", (["--steps-per-call", "1"], ["--steps-per-call", "3"]), ("1", "3"))])
def test_processes_started_with_other_flags_are_refused_naming_them(flag, flags, values, tmp_path):
    """Other device counts or --exact failed as `cannot reshape array of size 9 into shape
    (2,1)`; another --checkpoint-every or --steps-per-call desynchronised the collectives until
    the step timeout. Both processes now end in one line, before JAX's backend starts (every
    other field: test_processes_that_differ_in_any_field_are_refused_naming_it)."""
    port = free_port()
    procs = [subprocess.Popen(rank(r, port, *flags[r], "--checkpoint-dir", str(tmp_path / str(r)),
                              timeout="60"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    want = (f"python -m experiments.lenet: error: processes disagree: {flag} {values[0]} on "
            f"process 0, {flag} {values[1]} on process 1: start every process with the same "
            "flags\n")
    assert [p.returncode for p in procs] == [2, 2], errs
    assert errs == [want, want]


def test_a_process_lost_before_a_save_is_finished_ends_its_peer_in_one_line(tmp_path):
    """Process 1 dies where its save's closing barrier starts. Orbax's own barrier waits in
    JAX's coordination service, which learns of the loss only at the heartbeat timeout (here
    60 s) and then aborts process 0 in C++; jax-dp's barrier is a collective that fails at
    once. A SIGTERM while process 0 names the lost process (as the launcher sends one within
    0.2 s) must not replace its line by "interrupted"."""
    port = free_port()
    flags = ["--devices", "2", "--epochs", "1", "--checkpoint-dir", str(tmp_path),
             "--checkpoint-every", "1", "--steps-per-call", "1", "--heartbeat-timeout", "60"]
    sigterm_first = ("import os, signal; from jax_dp.checkpoint import Checkpointer as C; "
                     "newest = C.newest; "
                     "C.newest = lambda self: (os.kill(os.getpid(), signal.SIGTERM), newest(self))[1]")
    die_at_finalize = ("import os, orbax.checkpoint as ocp; "
                       "ocp.CheckpointManager._finalize = lambda *a, **k: os._exit(1)")
    procs = [subprocess.Popen(rank(r, port, *flags, timeout="60", patch=patch),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, patch in enumerate((sigterm_first, die_at_finalize))]
    try:
        procs[1].communicate(timeout=300)
        lost = time.monotonic()
        err = procs[0].communicate(timeout=120)[1]
    finally:
        for p in procs:
            p.kill()
    assert time.monotonic() - lost < 30  # Well before the 60 s heartbeat timeout.
    assert [p.returncode for p in procs] == [3, 1], err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "python -m experiments.lenet: error: process 1 of the run was lost "
        "(its connection closed during a collective); "), err


def rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of the launcher's child that runs rank."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                parent = status.read_text().split("PPid:")[1].split()[0]
                environ = (status.parent / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError):
                continue  # Gone meanwhile.
            if int(parent) == launcher.pid and f"JAX_PROCESS_ID={rank}".encode() in environ:
                return int(status.parent.name)
        time.sleep(0.1)
    raise TimeoutError(f"rank {rank} did not start")


def test_a_run_moves_between_processes_and_devices_and_outlives_a_lost_process(tmp_path):
    """The exact mode, 4 epochs of 10 steps: 2 processes x 1 device until process 0, the
    coordinator's, is SIGKILLed mid-epoch 3, then 1 process x 2 devices to the end: the
    uninterrupted run's params, optimizer state and history, bit for bit. Process 1 ends
    within 30 s in one line naming process 0 and the newest checkpoint, exit code 3, and
    nothing from JAX's runtime (which would end it in C++ on the coordinator's loss)."""
    flags = ["--exact", "--devices", "1", "--train-examples", "640", "--test-examples", "200",
             "--batch-size", "64", "--no-progress", "--checkpoint-dir", str(tmp_path / "ckpt"),
             "--json", str(tmp_path / "runs.json")]

    def part(epochs, devices, processes=None, *extra):
        command = [sys.executable, "-m", "experiments.lenet", *flags, "--epochs", str(epochs),
                   "--devices", str(devices), "--resume", *extra]
        if processes:
            command = [sys.executable, "-m", "experiments.launch", "--processes",
                       str(processes), "--", *command]
        return command

    def history():
        return [{k: v for k, v in e.items() if k != "time_s"}
                for e in json.loads((tmp_path / "runs.json").read_text())["runs"][0]["epochs"]]

    whole = subprocess.run(part(4, 1, None, "--checkpoint-dir", str(tmp_path / "whole")),
                           capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr
    want = history(), final_state(tmp_path / "whole")
    launcher = subprocess.Popen(part(4, 2, 2, "--checkpoint-every", "1", "--steps-per-call", "1"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim = rank_pid(launcher, 0)
    ckpt = tmp_path / "ckpt" / "bs64-lr0.2"
    while not (ckpt.is_dir() and any(p.name.isdigit() and int(p.name) > 22 for p in ckpt.iterdir())):
        assert launcher.poll() is None, launcher.communicate()
        time.sleep(0.02)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    out, err = launcher.communicate(timeout=120)
    assert time.monotonic() - killed < 30
    assert launcher.returncode == 128 + signal.SIGKILL
    step = max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    stopping = "python -m experiments.launch: process 0 ended (killed by SIGKILL); stopping the others"
    lines = err.splitlines()
    assert len(lines) == 2 and stopping in lines, err  # In either order.
    lost = lines[1 - lines.index(stopping)]
    assert lost.startswith("python -m experiments.lenet: error: process 0 of the run was lost ("), err
    assert lost.endswith(f"the newest checkpoint is step {step} in {ckpt}: resume with --resume "
                         "on the processes that remain")
    assert 22 < step < 40
    rest = subprocess.run(part(4, 2), capture_output=True, text=True, timeout=600)
    assert rest.returncode == 0 and "resuming from" in rest.stdout, rest.stderr
    assert history() == want[0]
    got = final_state(tmp_path / "ckpt")
    assert got[0] == want[1][0] == 40
    assert all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
               for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1][1])))


# A value unlike TrainConfig's default for every field and option a process could be given.
OTHER = {"model": "resnet18", "backend": "shard_map", "allreduce": "star", "devices": 4,
         "batch_size": 32, "lr": 0.1, "warmup_epochs": 1.0, "epochs": 1, "seed": 1, "exact": True,
         "compute_dtype": "bfloat16", "drop_remainder": True, "train_examples": 1000,
         "test_examples": 32}


@pytest.mark.parametrize("field", sorted(OTHER) + ["conv"])
def test_processes_that_differ_in_any_field_are_refused_naming_it(field):
    """Catches a field left out of what the processes compare (the seed was once)."""
    from jax_dp import distributed
    from jax_dp.config import TrainConfig
    from jax_dp.errors import ParamError

    ours = TrainConfig(options={"conv": "auto"})
    theirs = dataclasses.replace(ours, **({field: OTHER[field]} if field in OTHER else
                                          {"options": {"conv": "xla"}}),
                                 **({"options": {}} if field == "model" else {}))  # Its own options.
    with pytest.raises(ParamError, match=rf"^processes disagree: {field} .* on process 0, "
                                         rf"{field} .* on process 1:"):
        distributed.check_agree([distributed.agreed([ours]), distributed.agreed([theirs])])
    distributed.check_agree([distributed.agreed([ours])] * 2)


@pytest.mark.parametrize("option", ["checkpoint_every", "steps_per_call"])
def test_processes_that_differ_in_a_run_option_that_places_collectives_are_refused(option):
    """Catches an option left out: saves and calls are collectives every process must reach."""
    from jax_dp import distributed
    from jax_dp.config import RunOptions, TrainConfig
    from jax_dp.errors import ParamError

    ours, theirs = RunOptions(checkpoint_dir="runs"), RunOptions(checkpoint_dir="runs", **{option: 7})
    configs = [TrainConfig()]
    with pytest.raises(ParamError, match=rf"^processes disagree: {option} .* on process 0, "
                                         rf"{option} 7 on process 1:"):
        distributed.check_agree([distributed.agreed(configs, ours), distributed.agreed(configs, theirs)])
    assert distributed.AGREED_OPTIONS == ("checkpoint_every", "steps_per_call")


def test_every_field_has_a_value_to_disagree_on():
    from jax_dp.config import TrainConfig

    assert set(OTHER) == {f.name for f in dataclasses.fields(TrainConfig)} - {"options"}


# Each case: the variables a cluster manager sets, the manager, and the (count, rank) JAX reads.
MANAGED = {
    "srun": ({"SLURM_NTASKS": "3", "SLURM_PROCID": "2"}, "SLURM", (3, 2)),
    "mpirun": ({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "2"}, "Open MPI's mpirun", (3, 2)),
    # mpirun in a SLURM allocation: each process inherits the allocation's variables too.
    "mpirun in SLURM": ({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "2",
                         "SLURM_NTASKS": "6", "SLURM_PROCID": "0"}, "Open MPI's mpirun", (3, 2)),
    "Cloud TPU": ({"TPU_WORKER_HOSTNAMES": "t0,t1,t2", "TPU_WORKER_ID": "2"}, "Cloud TPU", (3, 2)),
    # Host 1 of the second of two slices of 3 hosts; JAX reads TPU_PROCESS_ADDRESSES first.
    "Cloud TPU slices": ({"TPU_PROCESS_ADDRESSES": "a,b,c", "TPU_WORKER_HOSTNAMES": "x",
                          "TPU_WORKER_ID": "1", "MEGASCALE_NUM_SLICES": "2",
                          "MEGASCALE_SLICE_ID": "1"}, "Cloud TPU", (6, 4)),
    "indexed Job": ({"JOB_COMPLETION_INDEX": "2", "JAX_NUM_PROCESSES": "3"},
                    "a Kubernetes indexed Job", (3, 2)),
}
MANAGERS_VARIABLES = ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_COORDINATOR_ADDRESS",
                      *{v for variables, _, _ in MANAGED.values() for v in variables})


@pytest.mark.parametrize("case", sorted(MANAGED))
def test_a_cluster_managers_processes_form_one_run_unless_single_process(case, monkeypatch):
    """Each manager's variables give the process count and rank JAX reads, and JAX's own
    detection is handed only what the user gave; --single-process ignores them (each process a
    run of its own) and joins nothing. Cloud TPU and Kubernetes are checked here only: no local
    install."""
    from jax_dp import distributed

    for name in MANAGERS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    variables, manager, (count, rank) = MANAGED[case]
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert distributed.cluster_manager() == manager
    assert (distributed.requested_processes(), distributed.requested_rank()) == (count, rank)
    if manager != "a Kubernetes indexed Job":  # Whose count is JAX's own variable, set by the user.
        assert (distributed.requested_processes(managed=False),
                distributed.requested_rank(managed=False)) == (1, 0)
        assert distributed.initialize(managed=False) is False
    joined = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: joined.append(a))
    monkeypatch.setattr(distributed, "_joined", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: name)  # kubernetes installed.
    assert distributed.initialize() is True
    assert joined == [(None, 3 if manager == "a Kubernetes indexed Job" else None, None)]
    assert distributed._joined == (count, rank)  # What the processes' agreement check counts on.
    monkeypatch.setenv("JAX_PROCESS_ID", "0")  # What the user set wins, 0 too.
    assert distributed.requested_rank() == 0


def test_a_single_process_of_a_cluster_manager_joins_nothing(monkeypatch):
    """mpirun -n 1 is one process, no run to join; an indexed Job's pods need their count;
    JAX's Kubernetes detection needs the kubernetes package."""
    from jax_dp import distributed

    for name in MANAGERS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    assert distributed.cluster_manager() is None and distributed.requested_processes() == 1
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")
    with pytest.raises(ValueError, match="^the pods of a Kubernetes indexed Job form one run: "
                                         "set JAX_NUM_PROCESSES to the Job's completions"):
        distributed.requested_processes()
    assert distributed.requested_processes(managed=False) == 1
    assert distributed.requested_processes(2) == 2  # The flag wins, asking no manager.
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install 'jax\[k8s\]'"):
        distributed.initialize()


def test_a_coordinator_name_that_resolves_to_loopback_is_refused_naming_coordinator_bind(monkeypatch):
    """A Debian or Ubuntu host maps its own name to 127.0.1.1: the coordinator would listen
    there, out of other hosts' reach, and they would wait out --start-timeout. An address, or
    a bind address of JAX's own variable, is taken as given."""
    from jax_dp import distributed
    from jax_dp.errors import ParamError

    resolve = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))] if host == "hosta"
        else resolve(host, *a, **k))
    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    with pytest.raises(ParamError) as e:
        distributed.initialize("hosta:12345", 2, 0)
    assert e.value.spelled(lambda name: "--" + name.replace("_", "-")) == (
        "--coordinator hosta:12345 resolves to 127.0.1.1 on this host, a loopback address no "
        "other host can reach: pass --coordinator-bind 0.0.0.0:12345 (or this host's own "
        "address) for processes on other hosts, or --coordinator 127.0.0.1:12345 for a run on "
        "this machine")
    distributed._check_reachable("127.0.1.1:12345")  # An address: what was asked for.
    distributed._check_reachable("localhost:12345")
    port = free_port()  # JAX's own variable is a bind address given: the start goes on to it.
    with socket.create_server(("127.0.0.1", port)):
        monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", f"127.0.0.1:{port}")
        with pytest.raises(ValueError, match=f"cannot start the coordinator at 127.0.0.1:{port}"):
            distributed.initialize("hosta:12345", 2, 0)
