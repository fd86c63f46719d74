"""Whether a run's compiled steps fit in the memory the process may really use, told before the
first step runs, with a batch size the same analysis says fits."""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import jax

from jax_dp.errors import ParamError

# The share of the room left that a suggested batch's step may need: XLA's analysis leaves out
# the runtime's own buffers, the host's copies of the data and malloc's reserves. Measured: LeNet
# on 8 devices in 5.2 GiB of address space trained at batch 12,000 (0.64 of the room by XLA's
# analysis) and failed at 14,904 (0.8).
MARGIN = 0.6


class Room(NamedTuple):
    """Bytes the process may still use, and what limits it."""
    bytes: int
    limit: str


def step_bytes(compiled) -> int | None:
    """Bytes one device needs to run compiled (XLA's memory analysis: arguments, outputs less
    those they alias, temporaries); None where XLA does not say."""
    analysis = getattr(compiled, "memory_analysis", lambda: None)()
    if analysis is None:
        return None
    return (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)


def host_room() -> Room | None:
    """What this process may still use of the host's memory: the least of the memory available
    (MemAvailable), its memory cgroup's limit less its usage (a container's limit), and its
    address-space limit less its size (RLIMIT_AS); None where none is known."""
    rooms = [Room(n, what) for n, what in (
        (meminfo_bytes("MemAvailable"), "the host has free"),
        (cgroup_room(), "its memory cgroup allows"),
        (address_room(), "its address-space limit allows")) if n is not None]
    return min(rooms) if rooms else None


def free_bytes(device: jax.Device) -> Room | None:
    """Room for device: on CPU the host's (host_room); elsewhere the device's own limit less
    what is in use."""
    if device.platform == "cpu":
        return host_room()
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return Room(stats["bytes_limit"] - stats.get("bytes_in_use", 0), f"{device.device_kind} has free")


def check_fits(compiled: Sequence, devices: Sequence[jax.Device], batch_size: int, pad_to: int,
               needs_at: Callable[[int], int | None] | None = None) -> None:
    """Refuse, in one line, a run whose largest compiled step needs more memory than its devices
    may use (CPU devices share the host's). needs_at(b), one device's bytes for a step of a
    global batch of b rows, finds a batch to suggest that fits with MARGIN to spare."""
    needs = [n for n in map(step_bytes, compiled) if n is not None]
    if not needs or not devices:
        return
    copies = len(devices) if devices[0].platform == "cpu" else 1
    need, room = max(needs) * copies, free_bytes(devices[0])
    if room is None or need <= room.bytes:
        return
    if needs_at is None:
        advice = "pass a smaller {}"
    elif fits := fitting_batch(batch_size, pad_to, max(needs), room.bytes * MARGIN / copies,
                               needs_at):
        advice = f"pass {{}} {fits} or smaller"
    else:
        advice = f"even {{}} {pad_to} does not fit: pass fewer --devices, or free memory"
    raise ParamError(("batch_size", "batch_size"), (
        f"{{}} {batch_size} needs about {need / 2**30:.1f} GiB a step on {copies} device(s), "
        f"more than the {room.bytes / 2**30:.1f} GiB {room.limit}: {advice}"))


def fitting_batch(batch_size: int, pad_to: int, need: int, budget: float,
                  needs_at: Callable[[int], int | None], tries: int = 6) -> int | None:
    """A global batch, a multiple of pad_to below batch_size, whose step needs_at says needs at
    most budget bytes a device (need: batch_size's); None if not even pad_to does. Each guess
    is a line through the last two measured points (the first through zero), then measured."""
    points = [(0, 0), (batch_size, need)]
    for _ in range(tries):
        (b0, n0), (b1, n1) = points[-2], points[-1]
        slope = (n1 - n0) / (b1 - b0) if b1 != b0 else float("inf")
        guess = int(b1 + (budget - n1) / slope) if slope > 0 else pad_to
        guess = max(pad_to, min(guess, batch_size - 1) // pad_to * pad_to)
        measured = needs_at(guess)
        if measured is None:
            return None
        if measured <= budget:
            return guess
        if guess == pad_to:
            return None
        points.append((guess, measured))
    return None


def meminfo_bytes(field: str) -> int | None:
    """A field of /proc/meminfo in bytes (MemAvailable: free for a new process); None if unknown."""
    return _field(Path("/proc/meminfo"), field)


def address_room() -> int | None:
    """RLIMIT_AS less this process's size; None without a limit."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    return None if limit == resource.RLIM_INFINITY else limit - (_field(Path("/proc/self/status"), "VmSize") or 0)


def cgroup_room(root: Path = Path("/sys/fs/cgroup"), cgroups: Path = Path("/proc/self/cgroup")) -> int | None:
    """The least room (limit less usage) of this process's memory cgroup and its ancestors:
    cgroup v2's memory.max and memory.current, or v1's memory.limit_in_bytes and
    memory.usage_in_bytes; None where none sets a limit."""
    try:
        lines = cgroups.read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, limit, usage = root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base, limit, usage = root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        folder = base / path.lstrip("/")
        for place in (folder, *folder.parents):
            cap = _number(place / limit)
            if cap is not None and cap < 2**62:  # v2 writes "max"; v1 a number near 2**63.
                rooms.append(cap - (_number(place / usage) or 0))
            if place == base:
                break
    return min(rooms) if rooms else None


def _number(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _field(path: Path, field: str) -> int | None:
    """A 'Field:   N kB' line of a /proc file, in bytes; None where there is none."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
