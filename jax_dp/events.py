"""A run's TensorBoard event files (tensorboardX: no TensorFlow needed), for process 0 to write."""

from __future__ import annotations

import json


class Events:
    """Scalars by global step: train/loss and train/acc (the epoch so far), train/lr and
    train/step_s while the run goes; epoch/train_loss, epoch/train_acc, epoch/test_acc and
    epoch/time_s at each epoch's end; the config as text."""

    def __init__(self, logdir: str, config: dict):
        from tensorboardX import SummaryWriter  # Imported by runs that write events only.

        self.writer = SummaryWriter(logdir)
        self.writer.add_text("config", f"```\n{json.dumps(config, indent=1)}\n```", 0)

    def step(self, global_step: int, loss: float, acc: float, lr: float, step_s: float) -> None:
        for name, value in (("loss", loss), ("acc", acc), ("lr", lr), ("step_s", step_s)):
            self.writer.add_scalar(f"train/{name}", value, global_step)

    def epoch(self, global_step: int, result: dict) -> None:
        for name in ("train_loss", "train_acc", "test_acc", "time_s"):
            self.writer.add_scalar(f"epoch/{name}", result[name], global_step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
