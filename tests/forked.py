"""Run many `python -m MODULE FLAGS...` commands from one interpreter, each in a fork made after
the imports they share, so each pays for its own work only. Prints a JSON list of
{"returncode", "stdout", "stderr"}, one per command.

`python -m tests.forked '[["experiments.lenet", "--devices", "0"], ...]'`
"""

import json
import os
import runpy
import sys
import tempfile
import traceback


def run(command: list[str], out: str, err: str) -> None:
    """In a forked child: command as `python -m` runs it, its output in out and err files."""
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = list(command)
    code = 0
    try:
        runpy.run_module(command[0], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(commands: list[list[str]]) -> list[dict]:
    # Imported here, never started: a fork before any JAX backend starts has no threads to lose.
    import jax  # noqa: F401

    import experiments.cli  # noqa: F401
    import experiments.process  # noqa: F401
    import jax_dp.train  # noqa: F401

    # A fork cannot restart itself under tcmalloc (experiments.process): that would start this
    # module, every command, again.
    os.environ["JAX_DP_NO_TCMALLOC"] = "1"
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, command in enumerate(commands):
            out, err = os.path.join(tmp, f"{i}.out"), os.path.join(tmp, f"{i}.err")
            sys.stdout.flush()
            sys.stderr.flush()
            if (pid := os.fork()) == 0:
                run(command, out, err)
            _, status = os.waitpid(pid, 0)
            with open(out) as o, open(err) as e:
                results.append({"returncode": os.waitstatus_to_exitcode(status),
                                "stdout": o.read(), "stderr": e.read()})
    return results


if __name__ == "__main__":
    json.dump(main(json.loads(sys.argv[1])), sys.stdout)
