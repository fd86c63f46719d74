"""What every experiment's process shares: tcmalloc preloaded, then bad input or a signal ending
it with one line on stderr."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Callable

from experiments.cli import OneLineParser

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def with_tcmalloc() -> None:
    """Re-run this process with tcmalloc preloaded when it is installed: XLA:CPU runs ~2x faster."""
    if os.path.exists(TCMALLOC) and "tcmalloc" not in os.environ.get("LD_PRELOAD", "") \
            and not os.environ.get("JAX_DP_NO_TCMALLOC"):
        preload = os.environ.get("LD_PRELOAD")  # Kept, after tcmalloc.
        env = dict(os.environ, LD_PRELOAD=f"{TCMALLOC}:{preload}" if preload else TCMALLOC)
        os.execve(sys.executable, [sys.executable] + sys.orig_argv[1:], env)


def run(main: Callable[[argparse.Namespace], None],
        make_parser: Callable[[], OneLineParser]) -> None:
    """Parse flags and run main; bad input becomes one line on stderr and exit code 2.

    The library names parameters (batch_size); the message names this CLI's flags
    (--batch-size). tcmalloc is preloaded first, before JAX is imported.
    """
    with_tcmalloc()
    # Orbax logs every save and TFDS its loading through absl; a failure among them is reported
    # in one line. The command shows its own lines only.
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    prog = f"python -m {getattr(sys.modules['__main__'].__spec__, 'name', 'experiments')}"
    for signum in (signal.SIGINT, signal.SIGTERM):  # Until train() records them between steps.
        signal.signal(signum, lambda n, _: leave(128 + n, f"{prog}: interrupted "
                                                 f"({signal.Signals(n).name})"))
    from jax_dp.errors import NamingError, ParamError

    try:
        p = make_parser()
    except ParamError as e:  # A --model that is no model: its flags cannot be known.
        leave(2, f"{prog}: error: {e.spelled(lambda n: '--' + n)}")
    args = p.parse_args()
    from jax_dp.train import Interrupted, ProcessLost

    try:
        main(args)
    except NamingError as e:  # Bad values, or a run that went non-finite: named as flags.
        leave(2, f"{p.prog}: error: {e.spelled(p.flag)}")
    except ValueError as e:
        leave(2, f"{p.prog}: error: {e}")
    except ProcessLost as e:  # Exit at once: JAX's shutdown would wait on the lost process.
        leave(3, f"{p.prog}: error: {e}")
    except Interrupted as e:
        hint = ": rerun with --resume" if e.saved else ": pass --checkpoint-dir to keep progress"
        leave(128 + e.signum, f"{p.prog}: {e}{hint}")
    except KeyboardInterrupt:  # A SIGINT that the handlers above did not see (another thread's).
        leave(130, f"{p.prog}: interrupted (SIGINT)")
    except (MemoryError, RuntimeError) as e:  # XLA's RESOURCE_EXHAUSTED is a RuntimeError.
        if not isinstance(e, MemoryError) and "RESOURCE_EXHAUSTED" not in str(e):
            raise
        leave(2, f"{p.prog}: error: out of memory during the run ({out_of_memory(e)}): pass a "
                 f"smaller {p.flag('batch_size')}, or fewer --devices")


def leave(code: int, line: str) -> None:
    """Print line on stderr and end the process now with code: the interpreter's shutdown would
    let XLA's and Orbax's threads add tracebacks to the line (or, after a SIGINT, crash)."""
    print(line, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def out_of_memory(e: BaseException) -> str:
    """What an out-of-memory error says, in a few words (XLA's message's first line)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:120] + ("..." if len(text) > 120 else "")
