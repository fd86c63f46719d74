"""TrainConfig: everything that defines a training run, validated once, saved whole."""

from __future__ import annotations

import dataclasses
import math

from jax_dp.allreduce import get_allreduce
from jax_dp.backends import BACKENDS
from jax_dp.errors import ParamError
from jax_dp.models import MODEL_OPTIONS, OPTION_CHOICES

DATA_SOURCES = ("debian", "tfds")
SIZES = {"train": 60_000, "test": 10_000}  # Fashion-MNIST's splits.


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What a run computes: two runs with equal configs give bitwise-equal params.

    Where things are (data and checkpoint folders) and how the run is watched (progress,
    timeouts, checkpoint interval) are not part of it; the data's content is checked by
    hash whatever folder it comes from. Only the options that `model` takes are used
    (`conv` for LeNet, `bn` for ResNet-18).
    """
    model: str = "lenet"
    conv: str = "auto"
    bn: str = "sync"
    activation: str = "relu"
    backend: str = "pmap"
    allreduce: str = "psum"
    devices: int = 1
    batch_size: int = 256
    lr: float = 0.2
    warmup_epochs: float = 0.0
    epochs: int = 4
    seed: int = 0
    drop_remainder: bool = False
    data: str = "debian"
    train_examples: int = SIZES["train"]
    test_examples: int = SIZES["test"]

    def __post_init__(self):
        _one_of("model", self.model, MODEL_OPTIONS)
        for option in MODEL_OPTIONS[self.model]:
            _one_of(option, getattr(self, option), OPTION_CHOICES[option])
        _one_of("backend", self.backend, BACKENDS)
        get_allreduce(self.allreduce, self.backend)
        _one_of("data", self.data, DATA_SOURCES)
        if self.model == "resnet18" and self.bn == "local" and self.backend not in ("pmap", "single"):
            raise ParamError(("bn", "backend"), "{} local keeps statistics per device, which only "
                             "{} pmap can hold; use it")
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
        for split in ("train", "test"):
            name, n, size = f"{split}_examples", getattr(self, f"{split}_examples"), \
                SIZES[split]
            _at_least(name, n, 1)
            if n > size:
                raise ParamError(name, f"{{}} {n} is more than the {size:,} {split} images of "
                                 f"Fashion-MNIST: pass {size} or fewer")

    def model_options(self) -> dict:
        """The keyword arguments of this config's model factory."""
        return {name: getattr(self, name) for name in MODEL_OPTIONS[self.model]}

    def fields(self) -> dict:
        """Every field that matters for this model, in order (the others are left out)."""
        unused = set(OPTION_CHOICES) - set(MODEL_OPTIONS[self.model])
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in unused}

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.fields().items())

    def resume_conflict(self, saved: dict) -> str | None:
        """The first field, other than a larger epochs, in which saved (a checkpoint's) differs."""
        for name, value in dataclasses.asdict(self).items():
            old = saved.get(name)
            if name == "epochs" and isinstance(old, int) and value >= old:
                continue
            if old != value:
                return name
        return None


def _one_of(name, value, choices):
    if value not in choices:
        raise ParamError(name, f"unknown {{}} {value!r}: use one of {', '.join(choices)}")


def _at_least(name, value, low):
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ParamError(name, f"{{}} must be at least {low}, got {value}")
