"""An experiment's output files (--json, --plot): checked before any work, written whole."""

from __future__ import annotations

import json
import os
from pathlib import Path

from jax_dp import files


def write_outputs(args, runs: list[dict], regular: bool = True, streams: bool = True) -> None:
    """Write --json and --plot for runs, each file whole or not at all: those that are regular
    files or not yet there (regular), those that are streams such as a FIFO (streams)."""
    payload = {"model": args.model, "runs": runs}
    wanted = lambda path: path is not None and (streams if files.is_stream(path) else regular)  # noqa: E731
    if wanted(args.json):
        write_json(args.json, payload)
    if wanted(args.plot) and runs:
        from experiments.measure import plots

        plots.plot_history(payload, args.plot)


def check_writable(path: Path | None, plot: bool = False) -> None:
    """Fail before training, not after, when an output file cannot be written (creating nothing);
    for a plot, also when matplotlib cannot write its format."""
    if path is None:
        return
    files.check(path)
    if plot:
        from experiments.measure import plots

        plots.check_format(path)


def check_folder(path: str, flag: str) -> None:
    """Fail before training when flag's folder cannot be made or written (creating nothing)."""
    files.check_folder(Path(path), flag)


def check_apart(args, folders: list[str]) -> None:
    """Refuse an output (a file, or --logdir's folder) that is, or lies in, what the run itself
    manages: each run's checkpoint folder (its lock, its checkpoints) and the prepared data
    (and its lock)."""
    from jax_dp import data

    managed = [(Path(folder), "the checkpoint folder") for folder in folders]
    managed += [(path, "the prepared data") for path in
                data.managed_paths(args.tfds_dir or data.default_data_dir())]
    for flag, path in (("--json", args.json), ("--plot", args.plot), ("--logdir", args.logdir)):
        if path is None:
            continue
        real = Path(os.path.realpath(path))
        for place, what in managed:
            place = Path(os.path.realpath(place))
            if real == place or place in real.parents:
                raise ValueError(f"{flag} {path} is in {what} ({place}), whose files the run "
                                 "manages: pass a path outside it")


def write_json(path: Path | None, payload: dict) -> None:
    """Write payload as indented JSON when a path was given, whole (files.write)."""
    if path is not None:
        files.write(path, (json.dumps(payload, indent=2) + "\n").encode())
