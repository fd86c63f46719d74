"""Orbax checkpoints of everything a bit-exact resume needs: state, metrics, the run's position."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import stat
import sys
from pathlib import Path
from typing import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jax_dp import distributed
from jax_dp.config import TrainConfig
from jax_dp.errors import ParamError
from jax_dp.models import per_device_state

def _quiet_closed_loops(unraisable, default=sys.unraisablehook) -> None:
    # After a failed TensorStore read (a damaged checkpoint), its threads still call back into
    # the event loop Orbax has closed; each call prints a traceback that says nothing to a user.
    if not (isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"):
        default(unraisable)


sys.unraisablehook = _quiet_closed_loops


class Checkpointer:
    """Saves a run's placed state under directory, at most once per global step.

    Saves are atomic (Orbax renames a finished save into place). Params and optimizer
    state are saved from one replica; the model state (BatchNorm statistics) from every
    device, so per-device statistics survive.
    """

    def __init__(self, directory: str | Path, config: TrainConfig, backend, keep: int = 2):
        self.directory, self.config, self.backend = Path(directory).absolute(), config, backend
        self.keep, self.manager = keep, _manager(directory, keep)
        self.lock = _lock(self.directory) if jax.process_index() == 0 else None

    def save(self, state, metrics, position) -> None:
        """Write state (a TrainState), the epoch's running metrics and position."""
        arrays = _on_host(self.backend, state, metrics, position)
        meta = {"config": dataclasses.asdict(self.config), "epoch": position.epoch,
                "step": position.step, "history": list(position.history), "epoch_s": position.epoch_s}
        try:
            self.manager.save(position.global_step, args=ocp.args.Composite(
                arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)))
        except Exception as e:  # A full disk or a folder gone read-only, as Orbax reports it.
            if distributed.lost_process(e):  # Not the disk: train() reports the lost process.
                raise
            raise ParamError("checkpoint_dir", f"cannot save a checkpoint in {self.directory} "
                             f"({_reason(e)}): free some space, or pass another {{}}") from None

    def restore(self, state, metrics, position, log: Callable[[str], None] = print):
        """(state, metrics, position) of the newest intact checkpoint, placed and typed like the
        arguments; None when there is none. A checkpoint of another config is refused. Newer
        steps that cannot be read are reported, kept as STEP.damaged, and skipped; if no step
        can be read, the resume is refused (nothing is moved)."""
        target = _on_host(self.backend, state, metrics, position)
        damaged = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                meta = _read(self.manager, step, meta=ocp.args.JsonRestore())["meta"]
                self._check_config(meta["config"])
                saved = self.manager.item_metadata(step)["arrays"].tree["state"]["model_state"]
                as_saved = {**target, "state": {**target["state"], "model_state": _laid_out_as(
                    target["state"]["model_state"], saved)}}
                arrays = _read(self.manager, step, arrays=ocp.args.StandardRestore(as_saved))["arrays"]
            except ParamError:
                raise
            except Exception as e:  # Orbax and TensorStore raise many types for damaged files.
                damaged.append((step, _reason(e)))
                continue
            for bad, reason in damaged:
                aside = self.directory / f"{bad}.damaged"
                if jax.process_index() == 0:  # Out of Orbax's way: a later save may reuse the step.
                    (self.directory / str(bad)).rename(aside)
                log(f"checkpoint step {bad} is damaged ({reason}): kept as {aside}, "
                    f"resuming from step {step}")
            if damaged:
                self.manager = _manager(self.directory, self.keep)
            return self._placed(arrays, meta, step, state, position, target["state"]["model_state"])
        if damaged:
            raise ParamError("checkpoint_dir", f"no intact checkpoint in {self.directory}: "
                             + "; ".join(f"step {s} is damaged ({r})" for s, r in damaged)
                             + ": pass another {} or remove this one to start again")
        return None

    def _check_config(self, saved: dict) -> None:
        diffs = self.config.differences(saved, fixed=fixed_fields(self.config))
        if diffs:
            raise _refusal(f"the checkpoint in {self.directory}", diffs)

    def _placed(self, arrays, meta, step, state, position, placed_statistics):
        """The restored arrays placed like state; placed_statistics: this run's model state on
        the host (to_host), whose layout the saved one is moved to."""
        b, host = self.backend, arrays["state"]
        statistics = _moved(host["model_state"], placed_statistics,
                            b.unreplicate(state.model_state), self.directory)
        state = state._replace(params=b.replicate(host["params"]),
                               model_state=b.from_host(statistics),
                               opt_state=b.replicate(host["opt_state"]))
        position = position._replace(
            epoch=meta["epoch"], step=meta["step"], global_step=step, order=arrays["order"],
            key=jax.random.wrap_key_data(arrays["key"]), history=tuple(meta["history"]),
            epoch_s=meta["epoch_s"])
        return state, b.replicate(arrays["metrics"]), position

    def newest(self) -> int | None:
        """The step of the newest checkpoint in the folder (None: none yet), read from the disk:
        a save that a lost process interrupted may have finished its files without telling Orbax."""
        self.manager.reload()
        return self.manager.latest_step()

    def release(self) -> None:
        """Let another run use the folder now, without Orbax's close (which would wait on every
        process of the run); close() then has nothing left to do."""
        self.manager = None
        if self.lock:
            self.lock.close()
            self.lock = None

    def close(self) -> None:
        """Finish pending writes and let another run use the folder."""
        try:
            if self.manager:
                self.manager.close()
        finally:
            if self.lock:
                self.lock.close()  # Closing the file releases its flock.


def saved_configs(root: str | Path) -> dict[str, dict]:
    """The runs saved in root's folders: folder name -> config of its newest readable checkpoint."""
    found = {}
    for folder in sorted(Path(root).iterdir()) if Path(root).is_dir() else []:
        manager = _manager(folder, keep=None) if folder.is_dir() else None
        for step in sorted(manager.all_steps(), reverse=True) if manager else []:
            try:
                found[folder.name] = _read(manager, step, meta=ocp.args.JsonRestore())["meta"]["config"]
                break
            except Exception:  # Damaged: the run's own resume reports it.
                continue
    return found


def check_resumable(root: str | Path, configs: list[TrainConfig]) -> None:
    """Refuse to resume configs from root when it holds runs and none of them is one of configs:
    the refusal names the fields in which the nearest saved run differs."""
    saved = saved_configs(root)

    def diff(config, saved_config):
        return config.differences(saved_config, fixed=fixed_fields(config))

    if not saved or any(not diff(c, s) for c in configs for s in saved.values()):
        return
    folder, diffs = min(((f, diff(c, s)) for c in configs for f, s in saved.items()),
                        key=lambda pair: len(pair[1]))
    raise _refusal(f"no run in {Path(root).absolute()} has this run's values; the nearest, "
                   f"{folder},", diffs)


def fixed_fields(config: TrainConfig) -> tuple[str, ...]:
    """The placement fields (config.PLACEMENT) a resume of config may not change: the devices
    where the model keeps a state of its own on each device."""
    return ("devices",) if per_device_state(config.model, config.options) else ()


def _laid_out_as(target, saved):
    """A restore target for the model state: target's leaves, but shaped as saved's (another run
    may have kept one copy, or one per device of another count)."""
    return jax.tree.map(lambda t, s: t if t.shape == tuple(s.shape) else np.zeros(s.shape, t.dtype),
                        target, saved, is_leaf=lambda x: hasattr(x, "shape"))


def _moved(saved, target, one, directory):
    """The model state saved with another device layout (saved), in this run's (target; one:
    a single copy's). Only a state equal on every device moves: else the refusal says why."""
    def move(s, t, o):
        if s.shape == t.shape:
            return s
        copies = s.reshape((-1, *o.shape))
        if not (copies == copies[0]).all():
            raise ParamError(("devices", "checkpoint_dir"), (
                f"cannot resume: the checkpoint in {directory} holds a state per device for "
                f"{len(copies)} device(s): resume with the same {{}}, or use another {{}}"))
        return np.broadcast_to(copies[0], t.shape).copy()
    return jax.tree.map(move, saved, target, one)


def _refusal(what: str, diffs: dict[str, tuple]) -> ParamError:
    """The one-line refusal of a resume: what was written with which values, and this run's."""
    names = list(diffs)
    written = " and ".join(f"{{}} {old!r}" for old, _ in diffs.values())
    this = " and ".join(f"{{}} {new!r}" for _, new in diffs.values())
    return ParamError((*names, *names, "checkpoint_dir"), (
        f"cannot resume: {what} was written with {written}, this run has {this} (only a larger "
        "epochs may change): resume with the same values or use another {}"))


def _on_host(backend, state, metrics, position) -> dict:
    """The arrays of a checkpoint, read from their devices."""
    return {"state": {"params": backend.unreplicate(state.params),
                      "model_state": backend.to_host(state.model_state),
                      "opt_state": backend.unreplicate(state.opt_state)},
            "metrics": backend.unreplicate(metrics), "order": np.asarray(position.order),
            "key": np.asarray(jax.random.key_data(position.key))}


def _read(manager, step, **items) -> dict:
    return manager.restore(step, args=ocp.args.Composite(**items))


def _reason(e: Exception) -> str:
    """An exception as a short phrase for one line of output."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:120]}{'...' if len(text) > 120 else ''}"


def _lock(directory: Path):
    """An exclusive flock on directory/.lock, holding this process's id; refused if another holds it.
    The kernel frees it when its holder ends, killed or not. The lock is opened without following
    a symbolic link, and only a regular file of its own is ever written: a planted link, FIFO or
    hard link is refused and left as it is."""
    path = directory / ".lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ParamError("checkpoint_dir", f"{path} is a symbolic link, not a lock of this "
                             "project's: remove it, or pass another {}") from None
        raise ParamError("checkpoint_dir", f"cannot write checkpoints to {directory} "
                         f"({e.strerror}): pass a writable {{}}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        what = "a hard link" if stat.S_ISREG(info.st_mode) else "not a regular file"
        raise ParamError("checkpoint_dir", f"{path} is {what}, not a lock of this project's: "
                         "remove it, or pass another {}")
    f = os.fdopen(fd, "r+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = f.read().strip() or "unknown"
        f.close()
        raise ParamError("checkpoint_dir", f"{directory} is in use by another run (process "
                         f"{holder}): wait for it to end, or pass another {{}}") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def _collective_barrier(*, key: str, timeout_ms: int) -> None:
    """Orbax's barrier between saves as a collective, which a lost process fails at once."""
    # Orbax's default waits in JAX's coordination service, which sees a lost process only at the
    # heartbeat timeout and then ends this process in C++, before it can say which was lost.
    # Saves are synchronous, so every barrier runs on the main thread, never two at once. Like a
    # step's collective it has no timeout of its own (timeout_ms): a hung peer is the heartbeat's.
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(key)


def _manager(directory, keep):
    try:
        return ocp.CheckpointManager(Path(directory).absolute(), options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=False, create=True,
            async_options=ocp.AsyncOptions(barrier_sync_fn=_collective_barrier)), item_handlers={
                "arrays": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})
    except OSError as e:
        raise ParamError("checkpoint_dir", f"cannot write checkpoints to {directory} "
                         f"({e.strerror}): pass a writable {{}}") from None
