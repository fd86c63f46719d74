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


def launch(command: list[str], processes: int, port: int | None = None, env: dict | None = None,
           **popen) -> int:
    """Run command as processes ranks (env: theirs, default ours; popen: to subprocess.Popen);
    the exit code is the first failure's (128 + N for a rank killed by signal N), else 0."""
    address = f"127.0.0.1:{port or free_port()}"
    procs = [subprocess.Popen(command, env={**(os.environ if env is None else env),
                                            "JAX_COORDINATOR_ADDRESS": address,
                                            "JAX_NUM_PROCESSES": str(processes),
                                            "JAX_PROCESS_ID": str(rank)}, **popen)
             for rank in range(processes)]
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:  # One rank died: the others would wait for it forever.
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                for p in procs:
                    p.wait()
                return exit_code(failed[0])
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        for p in procs:
            p.send_signal(signal.SIGINT)
        return max(exit_code(p.wait()) for p in procs) or 130


def main() -> None:
    """Parse `--processes N -- COMMAND...` and launch."""
    p = cli.parser(__spec__.name, __doc__)
    p.add_argument("--processes", type=cli.at_least(1), default=2,
                   help="how many processes to start")
    p.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    sys.exit(launch(command, args.processes, args.port))


if __name__ == "__main__":
    main()
