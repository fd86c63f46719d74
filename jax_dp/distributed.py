"""Several processes, one training run: JAX's own multi-process runtime (gloo collectives on CPU)."""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import re
import socket
import sys
import threading
import time
from typing import Callable

import jax

from jax_dp.config import LONGEST_S, check_seconds
from jax_dp.errors import ParamError
from jax_dp.relay import Relay


# JAX's default is 100 s: a run whose peer died would wait that long in its shutdown barrier.
HEARTBEAT_S = 10
# What JAX's runtime and its gloo collectives report when a peer process is gone, in words.
_LOST = {"heartbeat timeout": "it stopped sending heartbeats",
         "tasks are unhealthy": "it stopped sending heartbeats",
         "Connection reset by peer": "its connection closed during a collective",
         "Connection closed by peer": "its connection closed during a collective",
         "Gloo": "a collective with it failed"}
# Exit code of a process that ends because another of its run was lost (as train()'s callers use).
LOST_EXIT_CODE = 3
# The relay of a process other than 0 to the run's coordinator, once it has joined.
_relay: Relay | None = None
# (process count, this process's rank) of the multi-process run this process joined.
_joined: tuple[int, int] | None = None


def lost_process(error: BaseException) -> tuple[str, str] | None:
    """(which process, how it was seen to go) when error says a process of this multi-process
    run is gone, or error says nothing known but process 0's coordinator has gone meanwhile:
    ("process 1", "it stopped sending heartbeats"); "another process" where the error does not
    say which. None for any other error."""
    text = str(error)
    how = next((words for mark, words in _LOST.items() if mark in text), None)
    if how is None and _relay is not None and _relay.lost.is_set():
        return "process 0", "its coordinator's connection closed"
    if jax.process_count() == 1 or how is None:
        return None
    named = re.search(r"Task (\d+) heartbeat timeout", text)
    if named:
        return f"process {named.group(1)}", how
    if jax.process_count() == 2:
        return f"process {1 - jax.process_index()}", how
    return "another process", how


def _tpu_hosts() -> int | None:
    hosts = os.environ.get("TPU_PROCESS_ADDRESSES") or os.environ.get("TPU_WORKER_HOSTNAMES")
    return len(hosts.split(",")) if hosts else None


def _tpu_count() -> int | None:
    hosts = _tpu_hosts()
    return hosts and hosts * (_env_int("MEGASCALE_NUM_SLICES") or 1)


def _tpu_rank() -> int | None:
    worker = _env_int("TPU_WORKER_ID")
    return None if worker is None else worker + (_env_int("MEGASCALE_SLICE_ID") or 0) * _tpu_hosts()


def _indexed_job_count() -> int | None:
    if "JOB_COMPLETION_INDEX" not in os.environ:
        return None
    if "JAX_NUM_PROCESSES" not in os.environ:
        raise ValueError("the pods of a Kubernetes indexed Job form one run: set "
                         "JAX_NUM_PROCESSES to the Job's completions (or pass "
                         "--single-process for a run in each pod)")
    return _env_int("JAX_NUM_PROCESSES")


# Cluster managers that start every process of a run, in the order JAX's own detection
# (jax.distributed.initialize given no address) tries them, each with the process count and
# this process's rank as JAX reads them (None where it did not start us). JAX finds their
# coordinator. A Kubernetes indexed Job numbers its pods; JAX_NUM_PROCESSES says how many.
MANAGERS = {"Open MPI's mpirun": (lambda: _env_int("OMPI_COMM_WORLD_SIZE"),
                                  lambda: _env_int("OMPI_COMM_WORLD_RANK")),
            "SLURM": (lambda: _env_int("SLURM_NTASKS"), lambda: _env_int("SLURM_PROCID")),
            "Cloud TPU": (_tpu_count, _tpu_rank),
            "a Kubernetes indexed Job": (_indexed_job_count,
                                         lambda: _env_int("JOB_COMPLETION_INDEX"))}


def cluster_manager() -> str | None:
    """The cluster manager that started this process as one of several, if any."""
    return next((name for name, (count, _) in MANAGERS.items() if (count() or 1) > 1), None)


def requested_processes(num_processes: int | None = None, managed: bool = True) -> int:
    """How many processes the run has: the flag, $JAX_NUM_PROCESSES, the cluster manager's count
    (unless not managed), or 1."""
    _check_count(num_processes)
    given = num_processes or _env_int("JAX_NUM_PROCESSES")
    manager = None if given or not managed else cluster_manager()
    return given or (manager and MANAGERS[manager][0]()) or 1


def requested_rank(process_id: int | None = None, managed: bool = True) -> int:
    """This process's rank: the flag, $JAX_PROCESS_ID, the cluster manager's (unless not
    managed), or 0."""
    for rank in (process_id, _env_int("JAX_PROCESS_ID")):
        if rank is not None:
            return rank
    manager = cluster_manager() if managed else None
    rank = MANAGERS[manager][1]() if manager else None
    return 0 if rank is None else rank


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, bind: str | None = None,
               timeout_s: float = 60.0, heartbeat_s: int = HEARTBEAT_S,
               managed: bool = True) -> bool:
    """Join a multi-process run, if one is asked for; True when this process is in one.

    Values not given come from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID (what experiments.launch sets). Started by a cluster manager (MANAGERS:
    SLURM's srun, Open MPI's mpirun, Cloud TPU, a Kubernetes indexed Job) as one of several
    processes, JAX finds them itself, unless not managed (one process, whatever the environment
    says). Must run after simulating CPU devices, before any JAX operation.
    Process 0's coordinator listens on bind (HOST:PORT; default the coordinator's own address,
    so a loopback coordinator is not reachable from other machines). Joining takes at most
    timeout_s seconds, then is refused in one line; a signal meanwhile is handled at once.
    A process that stops answering JAX's heartbeats for heartbeat_s seconds ends the run
    (lost_process then names it).
    """
    _check_count(num_processes)
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = num_processes or _env_int("JAX_NUM_PROCESSES")
    host, _, port = (coordinator or "").rpartition(":")
    if coordinator and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"--coordinator must be HOST:PORT (process 0's address and a free "
                         f"port, e.g. localhost:12345), got {coordinator!r}")
    process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    manager = cluster_manager() if managed and not coordinator else None
    if not (coordinator or (num_processes or 1) > 1 or manager):
        return False
    if not manager and None in (coordinator, num_processes, process_id):
        raise ValueError("a multi-process run needs --coordinator HOST:PORT, --num-processes N "
                         "and --process-id I (or run it with python -m experiments.launch)")
    if not manager and not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id must be in 0..{num_processes - 1}, got {process_id}")
    check_seconds("start_timeout", timeout_s, LONGEST_S - 30)  # JAX's deadline is 30 s later.
    if manager == "a Kubernetes indexed Job" and importlib.util.find_spec("kubernetes") is None:
        raise ValueError("JAX finds a Kubernetes Job's coordinator through the kubernetes "
                         "package: pip install 'jax[k8s]' (or pass --coordinator HOST:PORT)")
    where = coordinator or f"{manager}'s coordinator"
    # JAX's own deadline comes later than ours: it ends the process in C++, ours in one line.
    if not (isinstance(heartbeat_s, int) and 1 <= heartbeat_s <= LONGEST_S):
        raise ParamError("heartbeat_timeout", f"{{}} must be a whole number of seconds from 1 to "
                         f"{LONGEST_S}, got {heartbeat_s}")
    options = {"initialization_timeout": int(timeout_s) + 30, "heartbeat_timeout_seconds": heartbeat_s}
    if coordinator:
        bind = bind or os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")  # JAX's own, if set.
        if process_id == 0:
            if not bind:
                _check_reachable(coordinator)
            _check_free(bind or coordinator)
        options["coordinator_bind_address"] = bind or coordinator
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address = coordinator
    if coordinator and process_id != 0:
        global _relay
        _relay = Relay(coordinator, lambda: _end_soon(heartbeat_s / 2))
        address = _relay.address
    try:
        _within(timeout_s, lambda: jax.distributed.initialize(address, num_processes,
                                                               process_id, **options))
    except TimeoutError:
        raise ParamError("start_timeout", f"process {requested_rank(process_id)} could not join "
                         f"the run at {where} "
                         f"within {timeout_s:g} s: start all {requested_processes(num_processes)} "
                         "processes with the same --coordinator, or pass a longer {}") from None
    except Exception as e:  # JAX's runtime reports a port in use or a refused peer so.
        reason = " ".join(str(e).split())[:160]
        raise ValueError(f"cannot join the run at {where} ({type(e).__name__}: {reason}): pass "
                         "a free port in --coordinator, reachable from every process") from None
    global _joined
    _joined = requested_processes(num_processes), requested_rank(process_id)
    return True


def _end_soon(grace_s: float) -> None:
    """Process 0 is gone: the run's next collective fails and names it; a process still in its
    run grace_s later (waiting on the runtime, not a collective) ends here in one line, before
    JAX's client would see its heartbeats go unanswered and end it in C++."""
    def end():
        if jax.distributed.is_initialized():  # Not a finished run's shutdown.
            sys.stderr.write("error: process 0 of the run was lost (its coordinator's connection "
                             "closed): resume with --resume on the processes that remain\n")
            sys.stderr.flush()
            os._exit(LOST_EXIT_CODE)

    timer = threading.Timer(grace_s, end)
    timer.daemon = True
    timer.start()


def _check_reachable(coordinator: str) -> None:
    """Refuse a coordinator named by a host name that resolves to a loopback address here (as a
    Debian or Ubuntu host's own name does, to 127.0.1.1): bound there, no other host reaches it."""
    host = coordinator.rpartition(":")[0].strip("[]")
    try:
        ipaddress.ip_address(host)
        return  # An address, not a name: where it listens is what was asked for.
    except ValueError:
        pass
    if host == "localhost":
        return
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return  # JAX reports a name it cannot resolve when it starts.
    if found and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in found):
        port = coordinator.rpartition(":")[2]
        raise ParamError("coordinator_bind", (
            f"--coordinator {coordinator} resolves to {', '.join(sorted(found))} on this host, a "
            f"loopback address no other host can reach: pass {{}} 0.0.0.0:{port} (or this host's "
            f"own address) for processes on other hosts, or --coordinator 127.0.0.1:{port} for a "
            "run on this machine"))


def _check_free(address: str) -> None:
    """Refuse a coordinator address whose port is taken (JAX's runtime crashes on it)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_server((host.strip("[]"), int(port)), reuse_port=False):
            pass
    except OSError as e:
        raise ValueError(f"cannot start the coordinator at {address} "
                         f"({os.strerror(e.errno)}): pass a free port in --coordinator") from None


def _within(seconds: float, start: Callable[[], object]) -> None:
    """start() in a thread of its own, waited for at most seconds (TimeoutError after): the
    main thread keeps running Python, so the handlers of SIGINT and SIGTERM run at once."""
    errors: list[BaseException] = []

    def run():
        try:
            start()
        except BaseException as e:  # Handed to the waiting thread.
            errors.append(e)

    thread = threading.Thread(target=run, name="jax-distributed-start", daemon=True)
    thread.start()
    deadline = time.monotonic() + seconds
    while thread.is_alive():
        if time.monotonic() > deadline:
            raise TimeoutError
        thread.join(0.1)
    if errors:
        raise errors[0]


def _check_count(num_processes: int | None) -> None:
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"--num-processes must be at least 1, got {num_processes}")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    try:
        return None if value is None else int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def check_same(configs: list, run_options=None, timeout_s: float = 60.0) -> None:
    """Refuse, in one line naming the flags and processes, a multi-process run whose processes
    were given other configs or run options (each would apply its own lr to the same summed
    gradients, or their collectives would not match). Compared right after joining, before
    JAX's backend starts: processes that disagree on their devices cannot start it together."""
    global _joined
    from orbax.checkpoint import multihost  # The runtime's key-value store: jax 0.10 names none.

    if _joined is None:
        return
    processes, rank = _joined
    client = multihost.get_jax_distributed_client()
    client.key_value_set(f"jax_dp/agreed/{rank}", json.dumps(agreed(configs, run_options),
                                                               sort_keys=True))
    runs = [json.loads(client.blocking_key_value_get(f"jax_dp/agreed/{i}", int(timeout_s * 1000)))
            for i in range(processes)]
    try:
        check_agree(runs)
    except ParamError:
        # Every process leaves the runtime together (shutdown is a barrier): otherwise process
        # 0's exit takes its coordinator away and JAX aborts a peer before it says why.
        _joined = None  # This process is in no run any more.
        jax.distributed.shutdown()
        raise


def check_agree(runs: list[list[dict]]) -> None:
    """Refuse, naming the first field and both values, processes whose runs (each process's
    configs' fields) are not all process 0's."""
    for rank, theirs in enumerate(runs):
        if theirs != runs[0]:
            names, words = _differences(runs[0], theirs)
            raise ParamError(tuple(n for n in names for _ in range(2)), (
                "processes disagree: " + "; ".join(f"{{}} {a} on process 0, {{}} {b} on process "
                                                   f"{rank}" for a, b in words)
                + ": start every process with the same flags"))


# The run options every process must share: when saves (each a collective) and calls fall.
AGREED_OPTIONS = ("checkpoint_every", "steps_per_call")


def agreed(configs: list, run_options=None) -> list[dict]:
    """What the processes of a run must agree on: every field of every run's config, and the
    run options that decide where its collectives fall (AGREED_OPTIONS of run_options)."""
    options = ({name: getattr(run_options, name) for name in AGREED_OPTIONS}
               if run_options is not None else {})
    return [{**c.fields(), **options} for c in configs]


def _differences(ours: list[dict], theirs: list[dict]) -> tuple[list[str], list[tuple]]:
    """The fields in which two processes' runs differ, and each value (the first run that does)."""
    if len(ours) != len(theirs):
        return ["devices"], [(f"{','.join(str(r['devices']) for r in ours)}",
                              f"{','.join(str(r['devices']) for r in theirs)}")]
    ours, theirs = next((a, b) for a, b in zip(ours, theirs) if a != b)
    names = [k for k in ours if ours.get(k) != theirs.get(k)]
    return names, [(ours.get(k), theirs.get(k)) for k in names]


def is_primary() -> bool:
    """Whether this process writes logs, JSON and plots (process 0)."""
    return jax.process_index() == 0
