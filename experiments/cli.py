"""What every experiment's command line shares: flag types, parsers, a model's flags, and the
flags as TrainConfigs."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Callable


def comma_list(kind: type, what: str) -> Callable[[str], list]:
    """A flag type that parses '1,2,4' into [1, 2, 4] of kind."""
    def parse(text: str) -> list:
        try:
            return [kind(part) for part in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} like {text.split(',')[0] or 1},... "
                                             f"got {text!r}") from None
    return parse


def at_least(low: int) -> Callable[[str], int]:
    """A flag type for an integer of at least low."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be an integer of at least {low}, got {text!r}")
        return value
    return parse


def step_range(text: str) -> tuple[int, int]:
    """A flag type for START:STOP, two whole numbers of global steps."""
    start, _, stop = text.partition(":")
    if not (start.isdigit() and stop.isdigit()):
        raise argparse.ArgumentTypeError(f"must be START:STOP, global steps like 10:20, got {text!r}")
    return int(start), int(stop)


def fraction(text: str) -> float:
    """A flag type for a number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < 1:  # nan fails too.
        raise argparse.ArgumentTypeError(f"must be a number from 0 up to (not including) 1, "
                                         f"got {text!r}")
    return value


def per_run(values: list, n: int, flag: str) -> list:
    """One value per run: a single value serves all n runs, else exactly n are needed."""
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise ValueError(f"{flag} has {len(values)} values for {n} device counts: "
                         f"give one, or one per count")
    return values


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def flag(self, param: str) -> str:
        """The flag that sets param (a dest), or param itself when no flag does."""
        return next((a.option_strings[0] for a in self._actions
                     if a.dest == param and a.option_strings), param)


class DefaultOnceFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows '(default: X)' once, and not at all where there is no default to show."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parser(module: str, doc: str) -> OneLineParser:
    """The parser every experiment starts from: its module name, its docstring's first line."""
    return OneLineParser(prog=f"python -m {module}", description=doc.splitlines()[0],
                         formatter_class=DefaultOnceFormatter)


def training_parser(module: str, doc: str, model: str, *, devices: str, batch_size: str,
                    lr: str, epochs: int, choose_model: bool = False) -> OneLineParser:
    """The flags of a training experiment for model (with choose_model, --model picks another);
    each TrainConfig field's flag has its field's name, each of the model's options its own."""
    from jax_dp import config

    p = parser(module, doc)
    if choose_model:
        p.add_argument("--model", default=model, help="a model named in jax_dp.models.MODELS, or "
                       "the import path of a module of your own (docs/models.md); its options "
                       "then have flags of their own")
    p.add_argument("--devices", type=comma_list(int, "counts"), default=devices,
                   help="device counts, one run each (on CPU, simulated devices)")
    p.add_argument("--batch-size", type=comma_list(int, "sizes"), default=batch_size,
                   help="global batch size split over the devices: one, or one per run")
    p.add_argument("--lr", type=comma_list(float, "rates"), default=lr,
                   help="SGD learning rate: one, or one per run")
    p.add_argument("--epochs", type=int, default=epochs, help="passes over the training set")
    p.add_argument("--seed", type=int, default=0, help="seed of params and data order")
    add_option_flags(p, model)
    from jax_dp import backends

    p.add_argument("--backend", default="pmap", choices=backends.BACKENDS,
                   help="how steps run over the devices: jax.pmap (the book's), jax.shard_map, "
                        "jax.jit with NamedSharding, or one device ('single', --devices 1)")
    p.add_argument("--allreduce", default="psum", choices=backends.ALLREDUCES,
                   help="how gradients are summed under pmap: lax.psum, the book's star, or a ring")
    p.add_argument("--train-examples", type=int, default=config.SIZES["train"],
                   help="train on the first N training examples")
    p.add_argument("--test-examples", type=int, default=config.SIZES["test"],
                   help="evaluate on the first N test examples")
    p.add_argument("--exact", action="store_true",
                   help="the same float32 bits on 1, 2, 4 or 8 devices: every sum over examples "
                        "in one fixed order (docs/exact.md)")
    p.add_argument("--compute-dtype", choices=config.COMPUTE_DTYPES, default="float32",
                   help="what activations and matrix products run in; params, gradient sums "
                        "and updates stay float32 (docs/bfloat16.md)")
    p.add_argument("--drop-remainder", action="store_true",
                   help="skip each epoch's last partial batch instead of padding it")
    p.add_argument("--checkpoint-dir", help="save checkpoints here (one folder per run)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="steps between checkpoints (0: at each epoch's end only)")
    p.add_argument("--resume", action="store_true",
                   help="continue each run from its latest checkpoint in --checkpoint-dir")
    p.add_argument("--step-timeout", type=float, default=300.0,
                   help="seconds one step may take before the run is declared wedged (exit 3)")
    p.add_argument("--steps-per-call", type=int,
                   help="training steps per compiled call, run under lax.scan with the "
                        "training split on the devices (default: the platform's measured best, "
                        "see docs/speed.md); checkpoints and signals then act between calls")
    p.add_argument("--log-every", type=float, default=60.0, metavar="SECONDS",
                   help="where no progress bar shows (output to a file, --no-progress): a line "
                        "with the UTC time, step, images/s, running loss and ETAs at most every "
                        "this many seconds (0: every step)")
    p.add_argument("--logdir", help="write TensorBoard event files here (process 0): the "
                   "running loss, accuracy, lr and step time every --scalars-every steps, each "
                   "epoch's history, the config")
    p.add_argument("--scalars-every", type=at_least(1), default=10, metavar="STEPS",
                   help="global steps between --logdir's running scalars (default 10)")
    p.add_argument("--profile", type=step_range, metavar="START:STOP",
                   help="keep a jax.profiler trace of global steps START to STOP in --logdir "
                        "(TensorBoard's profile plugin, XProf, Perfetto)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="show a progress bar within each epoch (on terminals only)")
    p.add_argument("--lr-scaling", default="none", choices=["none", "linear"],
                   help="linear: multiply each run's lr by its batch size / --base-batch-size")
    p.add_argument("--base-batch-size", type=int, default=256,
                   help="the batch size the given --lr is meant for, for --lr-scaling linear")
    p.add_argument("--warmup-epochs", type=float, default=0.0,
                   help="raise the learning rate linearly from 0 over this many epochs")
    p.add_argument("--json", type=Path, help="write the config and per-epoch history here")
    p.add_argument("--plot", type=Path, help="write a PNG of loss, accuracy and epoch time here")
    p.add_argument("--coordinator", help="HOST:PORT of process 0, for a multi-process run "
                   "(default: $JAX_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", type=int, help="processes in the run ($JAX_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, help="this process's rank ($JAX_PROCESS_ID)")
    p.add_argument("--single-process", action="store_true",
                   help="train as one process even when started by a cluster manager (SLURM's "
                        "srun, Open MPI's mpirun), whose processes otherwise form one run")
    p.add_argument("--coordinator-bind", metavar="HOST:PORT",
                   help="where process 0's coordinator listens (default: the --coordinator "
                        "address itself; JAX's runtime has no authentication, so keep the port "
                        "out of reach of untrusted machines)")
    p.add_argument("--start-timeout", type=float, default=60.0,
                   help="seconds to wait for every process to join a multi-process run")
    p.add_argument("--heartbeat-timeout", type=at_least(1), default=10,
                   help="seconds without a heartbeat after which a process of a multi-process "
                        "run counts as lost and the run ends (exit code 3)")
    p.add_argument("--data", default="auto", choices=config.DATA_SOURCES,
                   help="where Fashion-MNIST is prepared from, once: Debian's IDX files (debian, "
                        "offline), TFDS's download of them (download), or the first that is "
                        "there (auto)")
    p.add_argument("--idx-dir", default=config.DEBIAN_DIR,
                   help="folder holding the four IDX files (Debian's dataset-fashion-mnist)")
    p.add_argument("--download-url", default=config.FASHION_MNIST_URL,
                   help="where the four .gz files are downloaded from (TFDS's own URL, or a mirror)")
    p.add_argument("--download-checksums", metavar="FILE",
                   help="TFDS checksums file (URL, size, SHA-256, name per line) that a mirror's "
                        "downloads must match (TFDS's own URL's are registered by TFDS)")
    p.add_argument("--tfds-dir", help="TFDS data dir where the data is prepared "
                                      "($TFDS_DATA_DIR, else ~/tensorflow_datasets)")
    p.set_defaults(model=model)
    return p


def add_option_flags(p: argparse.ArgumentParser, model: str) -> None:
    """A flag for each option the model declares (models.declared): its default, its choices."""
    from jax_dp import models

    for option in models.declared(models.model_module(model)):
        p.add_argument(f"--{option.name.replace('_', '-')}", dest=option.name,
                       default=option.default, choices=option.choices, help=option.help)


def options_from_flags(args) -> dict:
    """The model options that args' flags set (add_option_flags')."""
    from jax_dp import models

    return {option.name: getattr(args, option.name)
            for option in models.declared(models.model_module(args.model))}


def chosen_model(default: str) -> str:
    """The --model on this process's command line (default without one), before full parsing."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", default=default)
    return p.parse_known_args()[0].model


def configs(args) -> list:
    """One TrainConfig per run: every field from its flag; devices, batch size and lr per run."""
    from jax_dp.config import TrainConfig

    if args.base_batch_size < 1:
        raise ValueError(f"--base-batch-size must be at least 1, got {args.base_batch_size}")
    n = len(args.devices)
    batch_sizes, lrs = per_run(args.batch_size, n, "--batch-size"), per_run(args.lr, n, "--lr")
    if args.lr_scaling == "linear":  # Goyal et al.: lr grows with the batch.
        lrs = [lr * b / args.base_batch_size for lr, b in zip(lrs, batch_sizes)]
    # Every other field has a flag of its name: a field without one fails here, loudly.
    shared = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
              if f.name not in ("devices", "batch_size", "lr", "options")}
    return [TrainConfig(**shared, options=options_from_flags(args), devices=k, batch_size=b, lr=lr)
            for k, b, lr in zip(args.devices, batch_sizes, lrs)]
