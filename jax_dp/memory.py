"""Whether a run's compiled steps fit in memory, told before the first step runs."""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Sequence

import jax

from jax_dp.errors import ParamError


def step_bytes(compiled) -> int | None:
    """Bytes one device needs to run compiled (XLA's memory analysis: arguments, outputs less
    those they alias, temporaries); None where XLA does not say."""
    analysis = getattr(compiled, "memory_analysis", lambda: None)()
    if analysis is None:
        return None
    return (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)


def free_bytes(device: jax.Device) -> int | None:
    """Bytes free for device: on CPU, the host's available memory within this process's
    address-space limit; elsewhere the device's own limit less what is in use."""
    if device.platform == "cpu":
        free = meminfo_bytes("MemAvailable")
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit != resource.RLIM_INFINITY:
            free = min(free, limit - _status("VmSize")) if free is not None else limit
        return free
    stats = device.memory_stats() or {}
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0) if "bytes_limit" in stats else None


def check_fits(compiled: Sequence, devices: Sequence[jax.Device], batch_size: int,
               pad_to: int) -> None:
    """Refuse, in one line naming a batch size that would fit, a run whose largest compiled step
    needs more memory than its devices have free (CPU devices share the host's memory)."""
    needs = [n for n in map(step_bytes, compiled) if n is not None]
    if not needs or not devices:
        return
    host = devices[0].platform == "cpu"
    need = max(needs) * (len(devices) if host else 1)
    free = free_bytes(devices[0])
    if free is None or need <= free:
        return
    fitting = max(pad_to, int(batch_size * 0.9 * free / need) // pad_to * pad_to)
    where = "the host" if host else devices[0].device_kind
    raise ParamError(("batch_size", "batch_size"), (
        f"{{}} {batch_size} needs about {need / 2**30:.1f} GiB a step on "
        f"{len(devices) if host else 1} device(s), more than the {free / 2**30:.1f} GiB {where} "
        f"has free: pass {{}} {fitting} or smaller"))


def meminfo_bytes(field: str) -> int | None:
    """A field of /proc/meminfo in bytes (MemAvailable: free for a new process); None if unknown."""
    return _field(Path("/proc/meminfo"), field)


def _status(field: str) -> int:
    return _field(Path("/proc/self/status"), field) or 0


def _field(path: Path, field: str) -> int | None:
    """A 'Field:   N kB' line of a /proc file, in bytes; None where there is none."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
