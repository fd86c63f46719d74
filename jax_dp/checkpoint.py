"""Orbax checkpoints of everything a bit-exact resume needs: state, metrics, the run's position."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from jax_dp.config import TrainConfig
from jax_dp.errors import ParamError

logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax logs every save at INFO/WARNING.


class Checkpointer:
    """Saves a run's placed state under directory, at most once per global step.

    Saves are atomic (Orbax renames a finished save into place). Params and optimizer
    state are saved from one replica; the model state (BatchNorm statistics) from every
    device, so per-device statistics survive.
    """

    def __init__(self, directory: str | Path, config: TrainConfig, backend, keep: int = 2):
        self.directory, self.config, self.backend = Path(directory).absolute(), config, backend
        self.manager = _manager(directory, keep)

    def save(self, state, metrics, position) -> None:
        """Write state (a TrainState), the epoch's running metrics and position."""
        arrays = _on_host(self.backend, state, metrics, position)
        meta = {"config": dataclasses.asdict(self.config), "epoch": position.epoch,
                "step": position.step, "history": list(position.history), "epoch_s": position.epoch_s}
        self.manager.save(position.global_step, args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)))

    def restore(self, state, metrics, position):
        """(state, metrics, position) of the latest checkpoint, placed and typed like the arguments;
        None when there is none. A checkpoint of another config is refused."""
        step = self.manager.latest_step()
        if step is None:
            return None
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        field = self.config.resume_conflict(meta["config"])
        if field is not None:
            saved = {**meta["config"], **meta["config"].get("options", {})}
            raise ParamError((field, field, "checkpoint_dir"), (
                f"cannot resume: the checkpoint in {self.directory} was written with {{}} "
                f"{saved.get(field)!r}, this run has {{}} {self.config.fields()[field]!r} "
                "(only a larger epochs may change): resume with the same values or use another {}"))
        b, target = self.backend, _on_host(self.backend, state, metrics, position)
        arrays = self.manager.restore(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(target)))["arrays"]
        host = arrays["state"]
        state = state._replace(params=b.replicate(host["params"]),
                               model_state=b.from_host(host["model_state"]),
                               opt_state=b.replicate(host["opt_state"]))
        position = position._replace(
            epoch=meta["epoch"], step=meta["step"], global_step=step, order=arrays["order"],
            key=jax.random.wrap_key_data(arrays["key"]), history=tuple(meta["history"]),
            epoch_s=meta.get("epoch_s", 0.0))  # Checkpoints before epoch_s: 0.
        return state, b.replicate(arrays["metrics"]), position

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


def _on_host(backend, state, metrics, position) -> dict:
    """The arrays of a checkpoint, read from their devices."""
    return {"state": {"params": backend.unreplicate(state.params),
                      "model_state": backend.to_host(state.model_state),
                      "opt_state": backend.unreplicate(state.opt_state)},
            "metrics": backend.unreplicate(metrics), "order": np.asarray(position.order),
            "key": np.asarray(jax.random.key_data(position.key))}


def _manager(directory, keep):
    try:
        return ocp.CheckpointManager(Path(directory).absolute(), options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=False, create=True))
    except OSError as e:
        raise ParamError("checkpoint_dir", f"cannot write checkpoints to {directory} "
                         f"({e.strerror}): pass a writable {{}}") from None
