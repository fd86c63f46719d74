"""The training commands' driver: one run per device count, one process or several, their
checkpoint folders, the book's lines and the output files."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

from experiments import outputs, xla_options
from experiments.cli import configs


def load_data(args):
    """The train and test splits the flags ask for."""
    from jax_dp import data

    load = dict(source=args.data, tfds_dir=args.tfds_dir, idx_dir=args.idx_dir,
                url=args.download_url, checksums=args.download_checksums)
    return (data.load_fashion_mnist("train", limit=args.train_examples, **load),
            data.load_fashion_mnist("test", limit=args.test_examples, **load))


def logdir_of(logdir: str | None, config, runs: int) -> str | None:
    """Where one of runs runs writes its TensorBoard events: logdir itself for a lone run, else
    a folder in it named for what tells the runs apart."""
    if logdir is None or runs == 1:
        return logdir
    return str(Path(logdir) / f"devices{config.devices}-bs{config.batch_size}-lr{config.lr:g}")


def train_runs(args) -> None:
    """Train once per device count, printing the book's lines; write --json and --plot."""
    from jax_dp import checkpoint, devices, distributed, train  # JAX starts later.
    from jax_dp.config import LONGEST_S, MICRO_BATCHES, RunOptions, check_seconds

    # Checked here, not only when a multi-process run starts: the flags are wrong either way.
    check_seconds("start_timeout", args.start_timeout, LONGEST_S - 30)  # JAX's: 30 s later.
    check_seconds("heartbeat_timeout", args.heartbeat_timeout)
    managed = not args.single_process
    processes = distributed.requested_processes(args.num_processes, managed)
    primary = processes == 1 or distributed.requested_rank(args.process_id, managed) == 0
    runs_configs = configs(args)
    folders = run_folders(args.checkpoint_dir, runs_configs) if args.checkpoint_dir else \
        [None] * len(runs_configs)
    outputs.check_apart(args, [folder for folder in folders if folder])
    outputs.check_writable(args.json if primary else None)
    outputs.check_writable(args.plot if primary else None, plot=True)
    if args.logdir and primary:
        outputs.check_folder(args.logdir, "--logdir")
    options = RunOptions(checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                         resume=args.resume, step_timeout=args.step_timeout,
                         steps_per_call=args.steps_per_call, progress=args.progress,
                         log_every=args.log_every, logdir=args.logdir,
                         scalars_every=args.scalars_every, profile=args.profile)
    xla_options.use(args.model, primary)
    exact = any(c.exact for c in runs_configs)  # The same bits on any count: devices.py.
    devices.setup_devices([c.devices for c in runs_configs], processes=processes,
                          at_least=MICRO_BATCHES if exact else 1,
                          start=lambda: distributed.initialize(
                              args.coordinator, args.num_processes, args.process_id,
                              bind=args.coordinator_bind, timeout_s=args.start_timeout,
                              heartbeat_s=args.heartbeat_timeout, managed=managed)
                          and distributed.check_same(runs_configs, options, args.start_timeout))
    primary = distributed.is_primary()
    if args.resume and args.checkpoint_dir:
        checkpoint.check_resumable(args.checkpoint_dir, runs_configs)
    train_data, test_data = load_data(args)
    runs, latest = [], []
    log = print if primary else (lambda line: None)

    def write(run):  # Files after every epoch, so a run stopped or killed keeps its epochs.
        latest[:] = [*runs, run]
        if primary:
            outputs.write_outputs(args, latest, streams=False)
    try:
        for config, folder in zip(runs_configs, folders):
            run = train.train(config, train_data, test_data, dataclasses.replace(
                options, checkpoint_dir=folder, progress=args.progress and primary,
                logdir=logdir_of(args.logdir, config, len(runs_configs))), log=log,
                on_epoch=write)
            run.pop("state")
            avg = sum(e["time_s"] for e in run["epochs"]) / len(run["epochs"])
            log(f"test acc: {run['epochs'][-1]['test_acc']:.2f}, {avg:.1f} sec/epoch "
                f"on {config.devices} device(s)")
            runs.append(run)
            latest[:] = runs
    except BaseException:  # Streams (a FIFO, a device) get the epochs so far, once.
        if primary:
            with contextlib.suppress(ValueError):  # The error that ended the run is the one to say.
                outputs.write_outputs(args, latest, regular=False)
        raise
    if primary:  # Files again too (a resumed run may have had no epoch left), and streams once.
        outputs.write_outputs(args, latest)


def run_folders(root: str, configs: list) -> list[str]:
    """Each run's checkpoint folder under root, named by what the run computes, not where: its
    global batch and lr (bs256-lr0.2), so a resume on another device count finds it. Runs of one
    command that share both are told apart by their order (bs256-lr0.2, bs256-lr0.2-2, ...)."""
    folders, seen = [], {}
    for config in configs:
        name = f"bs{config.batch_size}-lr{config.lr}"
        seen[name] = seen.get(name, 0) + 1
        folders.append(str(Path(root) / (name if seen[name] == 1 else f"{name}-{seen[name]}")))
    return folders
