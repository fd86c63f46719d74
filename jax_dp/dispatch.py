"""Bounded asynchronous dispatch: the guard against XLA:CPU's collective deadlock, and a watchdog."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any

import jax

# XLA:CPU can deadlock in a cross-device all-reduce when the host queues many steps
# without ever waiting, so no loop lets more than this many steps run ahead of the host.
MAX_IN_FLIGHT = 2
WEDGED_EXIT_CODE = 3


class InFlight:
    """Queue of dispatched steps; waits for the oldest once more than MAX_IN_FLIGHT are queued.

    If a step takes more than timeout_s to finish, the process prints one line and exits
    with code 3: a collective that waits forever must not become a silent hang.
    """

    def __init__(self, timeout_s: float | None = None):
        self.pending = collections.deque()
        self.watchdog = _Watchdog(timeout_s) if timeout_s else None

    def add(self, output: Any, info: Any = None) -> None:
        """Queue a step's output (info names it in errors); wait while too many are queued."""
        self.pending.append((output, info))
        while len(self.pending) > MAX_IN_FLIGHT:
            self._wait_oldest()

    def drain(self) -> None:
        """Wait for every queued step."""
        while self.pending:
            self._wait_oldest()

    def _wait_oldest(self):
        output, info = self.pending.popleft()
        if self.watchdog:
            with self.watchdog.waiting(info):
                jax.block_until_ready(output)
        else:
            jax.block_until_ready(output)


class _Watchdog:
    """A daemon thread that ends the process when one wait lasts longer than timeout_s
    (time the process spent suspended not counted)."""

    def __init__(self, timeout_s: float):
        self.timeout_s, self.since, self.info = timeout_s, None, None
        self.lock = threading.Lock()
        threading.Thread(target=self._watch, daemon=True).start()

    @contextlib.contextmanager
    def waiting(self, info):
        """Watch the wait inside this block; info names it in the error."""
        with self.lock:
            self.since, self.info = time.monotonic(), info
        try:
            yield
        finally:
            with self.lock:
                self.since = None

    def _watch(self):
        tick = min(1.0, self.timeout_s / 4)
        last = time.monotonic()
        while True:
            time.sleep(tick)
            now = time.monotonic()
            # A tick far longer than asked: the process was suspended (Ctrl-Z, SIGSTOP), and
            # that time is not the step's.
            suspended, last = max(0.0, now - last - 2 * tick), now
            with self.lock:
                if self.since is None:
                    continue
                self.since = min(self.since + suspended, now)
                if now - self.since > self.timeout_s:
                    sys.stderr.write(
                        f"error: {self.info or 'a step'} did not finish within {self.timeout_s:g} s; "
                        "a collective is probably wedged: rerun (with --resume if you "
                        "checkpoint), or raise --step-timeout if steps are just slow\n")
                    sys.stderr.flush()
                    os._exit(WEDGED_EXIT_CODE)


class _StopRequest:
    """The first SIGINT or SIGTERM received, if any."""
    signum: int | None = None


@contextlib.contextmanager
def stop_requests():
    """Inside this block SIGINT and SIGTERM are recorded, not raised, so the loop can stop cleanly."""
    request = _StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def record(signum, frame):
        request.signum = request.signum or signum

    previous = {s: signal.signal(s, record) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield request
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
