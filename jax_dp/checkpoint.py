"""Orbax checkpoints of a training run: everything needed to resume it bit for bit."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import orbax.checkpoint as ocp

logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax logs every save at INFO/WARNING.


class Snapshot(NamedTuple):
    """A run between two steps: host-side state, where it is in the data, what it logged.

    `state` holds params and optimizer state (replica 0) and model state (every replica,
    so per-device BatchNorm statistics survive); `metrics` the epoch's running sums;
    `order` the epoch's data order; `epoch` and `step` the next step to take;
    `key` the run's PRNG key data; `history` the finished epochs' results.
    """
    state: Any
    metrics: Any
    order: np.ndarray
    key: np.ndarray
    epoch: int
    step: int
    global_step: int
    history: list


class Checkpointer:
    """Saves Snapshots under directory (atomically: Orbax renames a finished save into place)."""

    def __init__(self, directory: str | Path, config: dict, keep: int = 2):
        self.directory, self.config = Path(directory).absolute(), config
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=False, create=True))
        except OSError as e:
            raise ValueError(f"cannot write checkpoints to {directory} ({e.strerror}): "
                             "pass a writable --checkpoint-dir") from None

    def save(self, snapshot: Snapshot) -> None:
        """Write snapshot as the checkpoint of its global step."""
        meta = {"config": self.config, "epoch": snapshot.epoch, "step": snapshot.step,
                "history": snapshot.history}
        arrays = {"state": snapshot.state, "metrics": snapshot.metrics, "order": snapshot.order,
                  "key": snapshot.key}
        self.manager.save(snapshot.global_step, force=True, args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)))

    def restore(self, template: Snapshot) -> Snapshot | None:
        """The latest snapshot, shaped like template; None when there is none yet."""
        step = self.manager.latest_step()
        if step is None:
            return None
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if meta["config"] != self.config:
            diff = {k: v for k, v in meta["config"].items() if self.config.get(k) != v}
            raise ValueError(f"the checkpoint in {self.directory} is of another run ({diff}); "
                             "resume with the same flags or use another --checkpoint-dir")
        target = {"state": template.state, "metrics": template.metrics, "order": template.order,
                  "key": template.key}
        arrays = self.manager.restore(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(target)))["arrays"]
        return Snapshot(arrays["state"], arrays["metrics"], arrays["order"], arrays["key"],
                        meta["epoch"], meta["step"], step, meta["history"])

    def close(self) -> None:
        """Finish pending writes."""
        self.manager.close()
