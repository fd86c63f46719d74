"""Start a multi-process run on this machine: N processes of one command, wired by JAX's runtime.

Run: `python -m experiments.launch --processes 2 -- python -m experiments.lenet --devices 4`
starts two processes (each with 2 simulated CPU devices) that train as one 4-device run;
process 0 prints and writes files. On real hosts, start the same command on each host with
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set (see the README).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from experiments import cli


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_code(returncode: int) -> int:
    """A child's return code as a shell reports it: a death by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


# How long the others may take to end once one rank failed: JAX's heartbeat timeout
# (distributed.HEARTBEAT_S) and then some; a rank still running after it is killed.
GRACE_S = 20.0

# How a rank ends when another one failed first: a lost process in train() exits 3, and JAX's
# runtime aborts one whose peer vanished. Seen together with another failure, that is the cause.
AFTERMATH = (3, -signal.SIGABRT)


def cause(failed: list[tuple[int, int]]) -> tuple[int, int]:
    """Of the (rank, return code) pairs seen failed together, the one that failed first."""
    return min(failed, key=lambda failure: failure[1] in AFTERMATH)


def launch(command: list[str], processes: int, port: int | None = None, env: dict | None = None,
           grace_s: float = GRACE_S, **popen) -> int:
    """Run command as processes ranks (env: theirs, default ours; popen: to subprocess.Popen);
    the exit code is the first failure's (128 + N for a rank killed by signal N), else 0.
    When a rank fails, the others get SIGTERM, and SIGKILL if still running grace_s later."""
    address = f"127.0.0.1:{port or free_port()}"
    procs = [subprocess.Popen(command, env={**(os.environ if env is None else env),
                                            "JAX_COORDINATOR_ADDRESS": address,
                                            "JAX_NUM_PROCESSES": str(processes),
                                            "JAX_PROCESS_ID": str(rank)}, **popen)
             for rank in range(processes)]
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
            if failed:  # One rank died: the others would wait for it until JAX's heartbeat.
                rank, code = cause(failed)
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                print(f"python -m {__spec__.name}: process {rank} ended ({how}); stopping the others",
                      file=sys.stderr, flush=True)
                _stop(procs, grace_s)
                return exit_code(code)
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        for p in procs:
            p.send_signal(signal.SIGINT)
        return max(exit_code(p.wait()) for p in procs) or 130


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to every running process, then SIGKILL to those still running after grace_s."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def parser() -> cli.OneLineParser:
    """`--processes N -- COMMAND...`."""
    p = cli.parser(__spec__.name, __doc__)
    p.add_argument("--processes", type=cli.at_least(1), default=2,
                   help="how many processes to start")
    p.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    return p


def main() -> None:
    """Parse `--processes N -- COMMAND...` and launch."""
    p = parser()
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    sys.exit(launch(command, args.processes, args.port))


if __name__ == "__main__":
    main()
