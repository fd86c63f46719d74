"""A run's TensorBoard event files (tensorboardX: no TensorFlow needed), for process 0 to write."""

from __future__ import annotations

import json

import jax


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


class Trace:
    """A jax.profiler trace of global steps [start, stop) kept in logdir, for TensorBoard's
    profile plugin, XProf or Perfetto."""

    def __init__(self, logdir: str, steps: tuple[int, int]):
        self.logdir, (self.start, self.stop) = logdir, steps
        self.tracing = False

    def before(self, global_step: int) -> None:
        """Start tracing if the step after global_step is one to trace."""
        if not self.tracing and self.start <= global_step < self.stop:
            jax.profiler.start_trace(self.logdir)
            self.tracing = True

    def after(self, global_step: int, state) -> None:
        """Stop tracing once global_step reaches stop, when state (the step's output) is ready."""
        if self.tracing and global_step >= self.stop:
            jax.block_until_ready(state)
            self.close()

    def close(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False
