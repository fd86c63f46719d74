"""TrainConfig: everything that defines a training run, validated once, saved whole; RunOptions: how a
run is kept and watched."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax_dp.backends.base import BACKENDS, check_allreduce
from jax_dp.errors import ParamError, check_choice
from jax_dp.models import model_options

# Where Fashion-MNIST is prepared from (jax_dp.data): Debian's files, TFDS's download, or the
# first that is there. Every source prepares the same verified bytes, so it is no part of a run.
DATA_SOURCES = ("auto", "debian", "download")
DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist.
# Where TFDS's own fashion_mnist downloads the four files from (plain HTTP): TFDS's registered
# SHA-256 of each download, and ours of its decompressed bytes, are what vouch for them.
FASHION_MNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
SIZES = {"train": 60_000, "test": 10_000}  # Fashion-MNIST's splits.
COMPUTE_DTYPES = ("float32", "bfloat16")  # What activations and products run in (models.precision).
MICRO_BATCHES = 8  # The exact mode's micro-batches per global batch (jax_dp.exact): a power of 2.
# Where and how a run's sums are taken, not what it computes: a resume may change them.
PLACEMENT = ("devices", "backend", "allreduce")


# JAX's runtime takes its timeouts as whole seconds in a 32-bit int (a larger one fails as
# "incompatible function arguments"); about 68 years, the longest timeout any flag takes.
LONGEST_S = 2**31 - 1


def check_seconds(name: str, seconds, longest: float = LONGEST_S) -> None:
    """Refuse a timeout that is not a finite, positive number of seconds up to longest."""
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds)
            and 0 < seconds <= longest):
        raise ParamError(name, f"{{}} must be a positive number of seconds up to {longest:.0f}, "
                         f"got {seconds}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What a run computes: two runs with equal configs give bitwise-equal params.

    Where things are (data and checkpoint folders) and how the run is watched (progress,
    timeouts, checkpoint interval) are not part of it; the data's content is checked by
    hash whatever folder it comes from. `options` are the model's own (its module's
    OPTIONS): checked here by the model's declaration and its own check, the defaults filled in.
    """
    model: str = "lenet"
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    backend: str = "pmap"
    allreduce: str = "psum"
    devices: int = 1
    batch_size: int = 256
    lr: float = 0.2
    warmup_epochs: float = 0.0
    epochs: int = 4
    seed: int = 0
    exact: bool = False
    compute_dtype: str = "float32"
    drop_remainder: bool = False
    train_examples: int = SIZES["train"]
    test_examples: int = SIZES["test"]

    def __post_init__(self):
        if not isinstance(self.options, dict):
            raise ParamError("options", f"{{}} must be a dict of the model's options, got "
                             f"{self.options!r}")
        check_choice("backend", self.backend, BACKENDS)
        # Frozen: the one assignment, of the options completed.
        object.__setattr__(self, "options", model_options(self.model, self.options, self.backend))
        check_allreduce(self.allreduce, self.backend)
        check_choice("compute_dtype", self.compute_dtype, COMPUTE_DTYPES)
        if self.exact:
            check_exact(self.backend, self.allreduce, self.devices, self.compute_dtype)
        _at_least("devices", self.devices, 1)
        if self.backend == "single" and self.devices != 1:
            raise ParamError(("backend", "devices"), f"{{}} single runs on one device, not "
                             f"{self.devices}: pass {{}} 1")
        _at_least("batch_size", self.batch_size, 1)
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ParamError("lr", f"{{}} must be a positive finite number, got {self.lr}")
        if not (math.isfinite(self.warmup_epochs) and self.warmup_epochs >= 0):
            raise ParamError("warmup_epochs", f"{{}} must be 0 or more, got {self.warmup_epochs}")
        _at_least("epochs", self.epochs, 1)
        if not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**63:
            raise ParamError("seed", f"{{}} must be a 64-bit integer (-2**63 to 2**63 - 1), got {self.seed}")
        for split in ("train", "test"):
            name, n, size = f"{split}_examples", getattr(self, f"{split}_examples"), \
                SIZES[split]
            _at_least(name, n, 1)
            if n > size:
                raise ParamError(name, f"{{}} {n} is more than the {size:,} {split} images of "
                                 f"Fashion-MNIST: pass {size} or fewer")
        if self.batch_size > self.train_examples:
            raise ParamError(("batch_size", "train_examples"), f"{{}} {self.batch_size} is more than "
                             f"the {self.train_examples} training examples ({{}}): pass at most "
                             f"{self.train_examples}")

    def fields(self) -> dict:
        """Every field in order, the model's options in place of `options`."""
        fields = dataclasses.asdict(self)
        options = fields.pop("options")
        return {"model": fields.pop("model"), **options, **fields}

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.fields().items())

    def differences(self, saved: dict, fixed: tuple[str, ...] = ()) -> dict[str, tuple]:
        """name -> (saved value, this value) for each field or model option in which saved (a
        checkpoint's config) differs, other than a larger epochs and the PLACEMENT fields that
        are not in fixed (a model whose state is per device fixes its devices)."""
        if saved.get("model") != self.model:  # Another model's options are no comparison.
            return {"model": (saved.get("model"), self.model)}
        saved = {**saved, **saved.get("options", {})}
        return {name: (saved.get(name), value) for name, value in self.fields().items()
                if saved.get(name) != value and (name in fixed or name not in PLACEMENT)
                and not (name == "epochs" and isinstance(saved.get(name), int) and value >= saved[name])}


def check_exact(backend: str, allreduce: str, devices: int, compute_dtype: str = "float32") -> None:
    """Refuse what the exact mode (jax_dp.exact) cannot make exact."""
    if compute_dtype != "float32":
        raise ParamError(("exact", "compute_dtype"), f"{{}} gives float32's bits; with {{}} "
                         f"{compute_dtype} BatchNorm's do not match across device counts: "
                         "leave it float32")
    if backend == "jit":
        raise ParamError(("exact", "backend"), "{} needs its sums in a fixed order, and under "
                         "{} jit XLA inserts its own all-reduces: use pmap or shard_map")
    if allreduce != "psum":
        raise ParamError(("exact", "allreduce"), "{} sums in its own fixed tree: leave {} psum")
    if MICRO_BATCHES % devices:
        raise ParamError(("exact", "devices"), f"{{}} cuts each batch into {MICRO_BATCHES} "
                         f"micro-batches, which {{}} {devices} does not divide: use 1, 2, 4 or 8")


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How a run is kept and watched, not what it computes (two runs that differ only here give
    the same bits). Validated once, here.

    checkpoint_dir: save the run here (Orbax) every checkpoint_every global steps (0: at each
      epoch's end only) and at each epoch's end; on SIGINT or SIGTERM, save and stop.
    resume: continue from the latest checkpoint in checkpoint_dir, if there is one.
    step_timeout: end the process (exit code 3) if a step takes longer than this many seconds
      (None: no watchdog).
    steps_per_call: steps per compiled call (jax_dp.feeds; None: the platform's measured best).
      Checkpoints, signals and the progress bar then act between calls.
    progress: show a progress bar within each epoch, on terminals only.
    log_every: where no bar shows, log a line (UTC time, step, images/s, running loss, ETAs)
      at most every this many seconds (0: after every call; None: never).
    logdir: write TensorBoard event files here (process 0): every scalars_every global steps
      the running loss, accuracy, lr and step time; each epoch's history; the config.
    scalars_every: global steps between TensorBoard's running scalars (a call of several steps
      writes once, at its end).
    profile: (start, stop): keep a jax.profiler trace of global steps start to stop in logdir.
    """
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    step_timeout: float | None = None
    steps_per_call: int | None = None
    progress: bool = False
    log_every: float | None = None
    logdir: str | None = None
    scalars_every: int = 10
    profile: tuple[int, int] | None = None

    def __post_init__(self):
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ParamError("checkpoint_every", f"{{}} must be 0 (epoch ends only) or more, "
                             f"got {self.checkpoint_every}")
        if self.step_timeout is not None:
            check_seconds("step_timeout", self.step_timeout)
        if self.steps_per_call is not None:
            _at_least("steps_per_call", self.steps_per_call, 1)
        if self.log_every is not None and not (isinstance(self.log_every, (int, float))
                                               and 0 <= self.log_every < math.inf):
            raise ParamError("log_every", f"{{}} must be a finite number of seconds, 0 or more, "
                             f"got {self.log_every}")
        if not isinstance(self.scalars_every, int) or self.scalars_every < 1:
            raise ParamError("scalars_every", f"{{}} must be a whole number of steps, 1 or more, "
                             f"got {self.scalars_every}")
        if self.profile is not None and not (self.logdir and 0 <= self.profile[0] < self.profile[1]):
            raise ParamError("profile", f"{{}} must be START:STOP, global steps with 0 <= START < "
                             f"STOP, and a logdir for the trace, got {self.profile[0]}:{self.profile[1]}")
        if (self.resume or self.checkpoint_every) and not self.checkpoint_dir:
            raise ParamError(("resume", "checkpoint_every", "checkpoint_dir"), "{} and {} need {}")


def _at_least(name, value, low):
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ParamError(name, f"{{}} must be at least {low}, got {value}")
