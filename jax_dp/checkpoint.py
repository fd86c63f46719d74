"""Where a run is (Record), and Orbax checkpoints of everything a bit-exact resume needs."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp

from jax_dp.config import TrainConfig
from jax_dp.errors import ParamError

logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax logs every save at INFO/WARNING.


class Record(NamedTuple):
    """Where a run is between two steps: `step` steps done of epoch `epoch` (0-based),
    `global_step` in all; the epoch's data `order`, the run's PRNG `key`, the finished
    epochs' results in `history`, and the seconds this epoch's steps took so far."""
    epoch: int
    step: int
    global_step: int
    order: np.ndarray
    key: jax.Array
    history: tuple = ()
    epoch_s: float = 0.0

    def stepped(self, steps: int = 1) -> Record:
        """The record `steps` steps later."""
        return self._replace(step=self.step + steps, global_step=self.global_step + steps)

    def next_epoch(self, result: dict, order: np.ndarray) -> Record:
        """The record at the start of the next epoch, this one's result kept."""
        return self._replace(epoch=self.epoch + 1, step=0, order=order,
                             history=self.history + (result,), epoch_s=0.0)


class Checkpointer:
    """Saves a run's placed state under directory, at most once per global step.

    Saves are atomic (Orbax renames a finished save into place). Params and optimizer
    state are saved from one replica; the model state (BatchNorm statistics) from every
    device, so per-device statistics survive.
    """

    def __init__(self, directory: str | Path, config: TrainConfig, backend, keep: int = 2):
        self.directory, self.config, self.backend = Path(directory).absolute(), config, backend
        self.manager = _manager(directory, keep)

    def save(self, state, metrics, record: Record) -> None:
        """Write state (a TrainState), the epoch's running metrics and record."""
        arrays = _on_host(self.backend, state, metrics, record)
        meta = {"config": dataclasses.asdict(self.config), "epoch": record.epoch,
                "step": record.step, "history": list(record.history), "epoch_s": record.epoch_s}
        self.manager.save(record.global_step, args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)))

    def restore(self, state, metrics, record: Record):
        """(state, metrics, record) of the latest checkpoint, placed like the arguments;
        None when there is none. A checkpoint of another config is refused."""
        step = self.manager.latest_step()
        if step is None:
            return None
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        field = self.config.resume_conflict(meta["config"])
        if field is not None:
            raise ParamError((field, field, "checkpoint_dir"), (
                f"cannot resume: the checkpoint in {self.directory} was written with {{}} "
                f"{meta['config'].get(field)!r}, this run has {{}} {getattr(self.config, field)!r} "
                "(only a larger epochs may change): resume with the same values or use another {}"))
        b, target = self.backend, _on_host(self.backend, state, metrics, record)
        arrays = self.manager.restore(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(target)))["arrays"]
        host = arrays["state"]
        state = state._replace(params=b.replicate(host["params"]),
                               model_state=b.from_host(host["model_state"]),
                               opt_state=b.replicate(host["opt_state"]))
        record = Record(meta["epoch"], meta["step"], step, arrays["order"],
                        jax.random.wrap_key_data(arrays["key"]), tuple(meta["history"]),
                        meta.get("epoch_s", 0.0))  # Checkpoints before epoch_s: 0.
        return state, b.replicate(arrays["metrics"]), record

    def close(self) -> None:
        """Finish pending writes."""
        self.manager.close()


def latest(directory: str | Path) -> tuple[int, dict, dict]:
    """(global step, arrays as saved, metadata) of the latest checkpoint in directory."""
    manager = _manager(directory, keep=None)
    step = manager.latest_step()
    if step is None:
        raise ParamError("checkpoint_dir", f"no checkpoint in {directory}: pass the {{}} of a run")
    restored = manager.restore(step, args=ocp.args.Composite(
        arrays=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    return step, restored["arrays"], restored["meta"]


def _on_host(backend, state, metrics, record) -> dict:
    """The arrays of a checkpoint, read from their devices."""
    return {"state": {"params": backend.unreplicate(state.params),
                      "model_state": backend.to_host(state.model_state),
                      "opt_state": backend.unreplicate(state.opt_state)},
            "metrics": backend.unreplicate(metrics), "order": np.asarray(record.order),
            "key": np.asarray(jax.random.key_data(record.key))}


def _manager(directory, keep):
    try:
        return ocp.CheckpointManager(Path(directory).absolute(), options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=False, create=True))
    except OSError as e:
        raise ParamError("checkpoint_dir", f"cannot write checkpoints to {directory} "
                         f"({e.strerror}): pass a writable {{}}") from None
