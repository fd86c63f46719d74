"""Choose k devices; on CPU, simulate them before JAX's backend starts."""

from __future__ import annotations

import os
from typing import Any, Callable

import jax
from jax._src import xla_bridge


def simulate_cpu_devices(k: int) -> None:
    """Make XLA:CPU expose k devices; a no-op for the GPU backend or when JAX_NUM_CPU_DEVICES is set."""
    if k < 1:
        raise ValueError(f"--devices must be at least 1, got {k}")
    if "JAX_NUM_CPU_DEVICES" in os.environ:  # The user's own choice wins.
        return
    if xla_bridge.backends_are_initialized():
        have = jax.local_device_count("cpu")
        if have < k:
            raise ValueError(
                f"JAX already started with {have} CPU devices, {k} needed: set up devices "
                "before the first JAX operation (or set JAX_NUM_CPU_DEVICES)")
        return
    # Only read when the CPU client is created, so this must precede any JAX operation.
    jax.config.update("jax_num_cpu_devices", k)


def get_devices(k: int) -> tuple[jax.Device, ...]:
    """The first k devices of the default backend (GPUs if any, else CPU).

    In a multi-process run, k counts devices over all processes: the first k / P local
    devices of each of the P processes.
    """
    if k < 1:
        raise ValueError(f"--devices must be at least 1, got {k}")
    processes = jax.process_count()
    if processes > 1:
        if k % processes:
            raise ValueError(f"--devices {k} does not split over {processes} processes: "
                             f"use a multiple of {processes}")
        per_process = k // processes
        if per_process > jax.local_device_count():
            raise ValueError(f"asked for {k} devices but only {jax.local_device_count()} exist "
                             f"in each of {processes} processes; pass --devices "
                             f"{jax.local_device_count() * processes} or fewer")
        return tuple(d for p in range(processes)
                     for d in [d for d in jax.devices() if d.process_index == p][:per_process])
    available = jax.local_devices()
    if k > len(available):
        names = ", ".join(str(d) for d in available)
        raise ValueError(
            f"asked for {k} devices but only {len(available)} exist ({names}); "
            f"pass --devices {len(available)} or fewer")
    return tuple(available[:k])


def setup_devices(counts: list[int], start: Callable[[], Any] = lambda: None,
                  processes: int = 1) -> list[tuple[jax.Device, ...]]:
    """Simulate enough CPU devices for the largest count, call start(), then pick each set.

    With several processes, counts are over all of them; start is where the multi-process
    runtime is joined, after the simulation is set up and before JAX starts.
    """
    if not counts or min(counts) < 1:
        raise ValueError(f"--devices must be positive counts, got {counts}")
    simulate_cpu_devices(-(-max(counts) // processes))
    start()
    return [get_devices(k) for k in counts]
