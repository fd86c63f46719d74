"""A run's choices made into what runs it: the model (the platform's convolution, its compute
dtype), the optimizer, the program (the backend, the book's steps or the exact mode's, the
all-reduce) and the feed. The loop gets them all in one call (assemble), the tools each piece
here, so none of them names a choice."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import optax

from jax_dp import data, feeds, models, schemes
from jax_dp.backends import make_backend
from jax_dp.config import TrainConfig
from jax_dp.exact import steps as exact_steps
from jax_dp.models import get_model
from jax_dp.models.model import Model
from jax_dp.models.precision import computing_in
from jax_dp.program import Program
from jax_dp.step import make_steps
from jax_dp.xla_cpu import auto_choices
from jax_dp.xla_cpu.conv import convolution


class Assembled(NamedTuple):
    """What runs a config: its model, optimizer, learning rate at each global step, steps per
    epoch, program and feed."""
    model: Model
    tx: optax.GradientTransformation
    learning_rate: optax.Schedule
    steps_per_epoch: int
    program: Program
    feed: feeds.HostBatches | feeds.DeviceCalls


def assemble(config: TrainConfig, devices: Sequence[jax.Device], platform: str,
             train_data: data.Split, steps_per_call: int) -> Assembled:
    """config made into what runs it on devices of platform, fed train_data steps_per_call
    steps per call."""
    model, tx = model_for(config, platform), optimizer(config)
    program = program_for(config, model, tx, devices)
    return Assembled(model, tx, learning_rate(config), steps_per_epoch(config), program,
                     feeds.make_feed(program, train_data, config.batch_size,
                                     config.drop_remainder, steps_per_call))


def make_model(name: str, platform: str | None = None, **options) -> Model:
    """The model called name with options (the model's declaration checks them), built for
    platform (default: JAX's default backend's)."""
    return _built(name, models.model_options(name, options), platform)


def model_for(config: TrainConfig, platform: str) -> Model:
    """config's model with its options (checked by the config), built for platform, computing
    in config.compute_dtype."""
    model = _built(config.model, config.options, platform)
    return computing_in(model, config.compute_dtype)


def _built(name: str, options: dict, platform: str | None) -> Model:
    """The model called name with its options complete: a model that convolves gets the
    platform's convolution (jax_dp.xla_cpu) as its conv_grads option asks."""
    options = dict(options)
    if "conv_grads" not in options:
        return get_model(name, **options)
    grads = options.pop("conv_grads")
    return get_model(name, convolution(grads, platform or jax.default_backend()), **options)


def described(config: TrainConfig, platform: str) -> str:
    """The run's config line, with what its 'auto' options stand for on platform."""
    chosen = auto_choices(config.options, platform)
    return f"config: {config}" + (f" (auto on {platform}: " + " ".join(
        f"{k}={v}" for k, v in chosen.items()) + ")" if chosen else "")


def optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """SGD at learning_rate(config); a constant lr as a number (no step count in its state)."""
    return optax.sgd(learning_rate(config) if _warmup_steps(config) else config.lr)


def learning_rate(config: TrainConfig) -> optax.Schedule:
    """The learning rate at each global step: config.lr, reached linearly from 0 over
    config.warmup_epochs."""
    warmup_steps = _warmup_steps(config)
    return optax.linear_schedule(0.0, config.lr, warmup_steps) if warmup_steps else \
        optax.constant_schedule(config.lr)


def _warmup_steps(config: TrainConfig) -> int:
    return round(config.warmup_epochs * steps_per_epoch(config))


def steps_per_epoch(config: TrainConfig) -> int:
    """Steps in one of config's epochs."""
    return data.num_batches(config.train_examples, config.batch_size, config.drop_remainder)


def program_for(config: TrainConfig, model: Model, tx: optax.GradientTransformation,
                devices: Sequence[jax.Device]) -> Program:
    """config's program for model and tx over devices."""
    return build(model, tx, config.backend, devices, exact=config.exact,
                 allreduce=config.allreduce)


def build(model: Model, tx: optax.GradientTransformation, backend: str,
          devices: Sequence[jax.Device], *, exact: bool = False, allreduce: str = "psum",
          donate: bool = True) -> Program:
    """The book's steps on backend over devices, gradients summed by the all-reduce called allreduce (schemes.py); or,
    with exact, the exact mode's (jax_dp.exact)."""
    placed = make_backend(backend, devices)
    if exact:
        return Program(placed, exact_steps.make_steps(model, tx, placed.axis_name), donate)
    return Program(placed, make_steps(model, tx, placed.axis_name, schemes.for_step(allreduce)),
                   donate)
