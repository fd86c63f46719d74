"""How far a run is: tqdm's bar on a terminal, and a timestamped line every few seconds where
no bar shows (nohup, a batch system's log file)."""

from __future__ import annotations

import contextlib
import datetime
import time
from typing import Callable

import tqdm


def duration(seconds: float) -> str:
    """seconds as the largest two units: 1h02m, 3m05s, 12s."""
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s % 60:02d}s" if m else f"{s}s"


class Progress:
    """Reports each step of a run of epochs x per_epoch steps of global_batch examples: on a
    terminal (and asked for) as a bar with the run's ETA; where no bar shows, a line to log
    with the epoch's running loss and accuracy at most every log_every_s seconds (0: after
    every call of steps; None: never). Every report_every global steps the same go to report
    (global step, loss, accuracy, seconds per step)."""

    def __init__(self, log: Callable[[str], None], *, epochs: int, per_epoch: int,
                 global_batch: int, bar: bool, log_every_s: float | None,
                 report: Callable[[int, float, float, float], None] | None = None,
                 report_every: int = 10, clock: Callable[[], float] = time.monotonic):
        self.log, self.epochs, self.per_epoch, self.global_batch = log, epochs, per_epoch, global_batch
        self.show_bar, self.every, self.clock = bar, log_every_s, clock
        self.report, self.report_every = report, report_every
        self.started = self.last = clock()  # Made when the steps start: rates leave out compiling.
        self.steps = 0
        self.bar = None

    @contextlib.contextmanager
    def epoch(self, epoch: int, step: int):
        """Steps of epoch (0-based) from step on, inside."""
        self.bar = tqdm.tqdm(total=self.per_epoch, initial=step, desc=f"epoch {epoch + 1}",
                             unit="batch", leave=False, disable=None if self.show_bar else True)
        try:
            yield
        finally:
            self.bar.close()

    def stepped(self, epoch: int, step: int, n: int, running: Callable[[], tuple[float, float]]):
        """n more steps done, now at step of epoch; running() gives the epoch's (loss so far,
        accuracy so far), waiting for the steps, and is called only when a line or report is due."""
        now = self.clock()
        self.steps += n
        left = (self.epochs - epoch) * self.per_epoch - step  # Steps to the run's end.
        rate = self.steps / max(now - self.started, 1e-9)  # Steps a second.
        self.bar.update(n)
        if not self.bar.disable:
            self.bar.set_postfix_str(f"run ETA {duration(left / rate)}", refresh=False)
        at = epoch * self.per_epoch + step  # The global step.
        reporting = self.report is not None and at // self.report_every > (at - n) // self.report_every
        line_due = self.bar.disable and self.every is not None and now - self.last >= self.every
        if not (reporting or line_due):
            return
        loss, acc = running()
        if reporting:
            self.report(at, loss, acc, 1 / rate)
        if line_due:
            self.last = now
            stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            self.log(f"{stamp} epoch {epoch + 1}/{self.epochs} step {step}/{self.per_epoch}: "
                     f"{rate * self.global_batch:.1f} images/s, loss {loss:.4f}, train acc "
                     f"{acc:.3f}, epoch ETA {duration((self.per_epoch - step) / rate)}, "
                     f"run ETA {duration(left / rate)}")
