"""A model as (init, apply), two pure functions, so one train step serves every model."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax


class Model(NamedTuple):
    """init(key) -> (params, state); apply(params, state, x, mask, *, train, axis_name) -> (logits, state).

    `state` holds what training updates besides params (BatchNorm statistics); `mask`
    marks real rows (1) against padding (0); `axis_name` names the data-parallel axis
    that statistics are synchronised over, or is None on one device. With `micro` True,
    apply also takes micro=n: x's rows are n micro-batches, each layer computed on each alone
    and each sum over rows taken in jax_dp.micro's tree (the exact mode, for batch statistics).
    """
    init: Callable[[jax.Array], tuple[Any, Any]]
    apply: Callable[..., tuple[jax.Array, Any]]
    micro: bool = False


class Option(NamedTuple):
    """An option a model module declares: the command lines make it a flag --name."""
    name: str
    default: str
    choices: tuple[str, ...]
    help: str


# ReLU as in the book; softplus is a kink-free stand-in for parity experiments: float32
# round-off can tip a ReLU input across zero on one device count and not on another.
ACTIVATIONS = {"relu": jax.nn.relu, "softplus": jax.nn.softplus}
ACTIVATION = Option("activation", "relu", tuple(ACTIVATIONS),
                    "relu (the book's), or softplus, which has no kink for round-off to tip a "
                    "unit across")
CONV_GRADS = Option("conv_grads", "auto", ("auto", "canonical", "xla"),
                    "convolution gradients as canonical forward convolutions (measured faster on "
                    "XLA:CPU) or XLA's own; auto: canonical on CPU, XLA's own elsewhere")
