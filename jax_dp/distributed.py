"""Several processes, one training run: JAX's own multi-process runtime (gloo collectives on CPU)."""

from __future__ import annotations

import os

import jax


def requested_processes(num_processes: int | None = None) -> int:
    """How many processes the run has: the flag, $JAX_NUM_PROCESSES, SLURM's task count, or 1."""
    _check_count(num_processes)
    return (num_processes or _env_int("JAX_NUM_PROCESSES") or _env_int("SLURM_NTASKS") or 1)


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Join a multi-process run, if one is asked for; True when this process is in one.

    Values not given come from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID (what experiments.launch sets); under SLURM with several tasks, JAX
    finds them itself. Must run after simulating CPU devices, before any JAX operation.
    """
    _check_count(num_processes)
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = num_processes or _env_int("JAX_NUM_PROCESSES")
    host, _, port = (coordinator or "").rpartition(":")
    if coordinator and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"--coordinator must be HOST:PORT (process 0's address and a free "
                         f"port, e.g. localhost:12345), got {coordinator!r}")
    process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    slurm = (_env_int("SLURM_NTASKS") or 1) > 1 and not coordinator
    if not (coordinator or (num_processes or 1) > 1 or slurm):
        return False
    if not slurm and None in (coordinator, num_processes, process_id):
        raise ValueError("a multi-process run needs --coordinator HOST:PORT, --num-processes N "
                         "and --process-id I (or run it with python -m experiments.launch)")
    if not slurm and not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id must be in 0..{num_processes - 1}, got {process_id}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id)
    return True


def _check_count(num_processes: int | None) -> None:
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"--num-processes must be at least 1, got {num_processes}")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    try:
        return None if value is None else int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def is_primary() -> bool:
    """Whether this process writes logs, JSON and plots (process 0)."""
    return jax.process_index() == 0
