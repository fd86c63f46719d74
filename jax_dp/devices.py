"""Choose k devices; on CPU, simulate them before JAX's backend starts."""

from __future__ import annotations

import os

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
    """The first k devices of the default backend (GPUs if any, else CPU)."""
    if k < 1:
        raise ValueError(f"--devices must be at least 1, got {k}")
    available = jax.local_devices()
    if k > len(available):
        names = ", ".join(str(d) for d in available)
        raise ValueError(
            f"asked for {k} devices but only {len(available)} exist ({names}); "
            f"pass --devices {len(available)} or fewer")
    return tuple(available[:k])


def setup_devices(counts: list[int]) -> list[tuple[jax.Device, ...]]:
    """Simulate enough CPU devices for the largest count, then pick each set."""
    if not counts or min(counts) < 1:
        raise ValueError(f"--devices must be positive counts, got {counts}")
    simulate_cpu_devices(max(counts))
    return [get_devices(k) for k in counts]
