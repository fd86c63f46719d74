"""Choose k devices; on CPU, simulate them before JAX's backend starts."""

from __future__ import annotations

import os
from typing import Any, Callable

import jax

from jax_dp.errors import ParamError


# XLA:CPU runs one process's collectives on 256 threads: with more simulated devices the
# others never reach an all-reduce's rendezvous and XLA aborts after 40 s (measured).
MAX_SIMULATED = 256


def check_simulated(k: int) -> None:
    """Refuse more simulated CPU devices than XLA:CPU's collectives can serve. Whether their
    steps fit in memory is judged from the compiled steps (memory.check_fits)."""
    if k > MAX_SIMULATED:
        raise ParamError("devices", f"{{}} {k} is more than the {MAX_SIMULATED} CPU devices XLA "
                         f"can simulate in one process (its collectives run on {MAX_SIMULATED} "
                         f"threads): pass {MAX_SIMULATED} or fewer, or use more processes")


def check_count(k: int) -> None:
    """Refuse a device count below 1."""
    if k < 1:
        raise ParamError("devices", f"{{}} must be at least 1, got {k}")


def simulate_cpu_devices(k: int) -> None:
    """Make XLA:CPU expose k devices (checked by check_simulated); a no-op for the GPU
    backend or when JAX_NUM_CPU_DEVICES is set."""
    check_count(k)
    check_simulated(k)
    if "JAX_NUM_CPU_DEVICES" in os.environ:  # The user's own choice wins.
        return
    try:
        # Only read when the CPU client is created: JAX refuses a new value after that.
        jax.config.update("jax_num_cpu_devices", k)
    except RuntimeError:  # JAX has started: its CPU devices are what they are.
        have = jax.local_device_count("cpu")
        if have < k:
            raise ValueError(
                f"JAX already started with {have} CPU devices, {k} needed: set up devices "
                "before the first JAX operation (or set JAX_NUM_CPU_DEVICES)") from None


def get_devices(k: int) -> tuple[jax.Device, ...]:
    """The first k devices of the default backend (GPUs if any, else CPU).

    In a multi-process run, k counts devices over all processes: the first k / P local
    devices of each of the P processes.
    """
    check_count(k)
    processes = jax.process_count()
    if processes > 1:
        check_split(k, processes)
        per_process = k // processes
        if per_process > jax.local_device_count():
            raise ParamError("devices", f"asked for {k} devices but only "
                             f"{jax.local_device_count()} exist in each of {processes} processes; "
                             f"pass {{}} {jax.local_device_count() * processes} or fewer")
        return tuple(d for p in range(processes)
                     for d in [d for d in jax.devices() if d.process_index == p][:per_process])
    available = jax.local_devices()
    if k > len(available):
        names = ", ".join(str(d) for d in available)
        raise ParamError("devices", f"asked for {k} devices but only {len(available)} exist "
                         f"({names}); pass {{}} {len(available)} or fewer")
    return tuple(available[:k])


def check_split(k: int, processes: int) -> None:
    """Refuse a device count that the processes cannot share equally."""
    if k % processes:
        raise ParamError("devices", f"{{}} {k} does not split over {processes} processes: "
                         f"use a multiple of {processes}")


def setup_devices(counts: list[int], start: Callable[[], Any] = lambda: None,
                  processes: int = 1, at_least: int = 1) -> list[tuple[jax.Device, ...]]:
    """Simulate enough CPU devices for the largest count, call start(), then pick each set.

    With several processes, counts are over all of them; start is where the multi-process
    runtime is joined, after the simulation is set up and before JAX starts. Each process simulates at least at_least devices: XLA:CPU shares a process's threads among its
    simulated devices, and how a convolution splits its sums over threads (so its bits)
    follows their count; the exact mode fixes it for every device count (config.MICRO_BATCHES).
    """
    if not counts or min(counts) < 1:
        raise ParamError("devices", f"{{}} must be positive counts, got {counts}")
    for k in counts:  # Before joining: every process refuses alike, none waits on another.
        check_split(k, processes)
    simulate_cpu_devices(max(-(-max(counts) // processes), at_least))
    start()
    return [get_devices(k) for k in counts]
