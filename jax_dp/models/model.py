"""A model as (init, apply), two pure functions, so one train step serves every model."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax

from jax_dp.models import Option

class Model(NamedTuple):
    """init(key) -> (params, state); apply(params, state, x, mask, *, train, axis_name) -> (logits, state).

    `state` holds what training updates besides params (BatchNorm statistics); `mask`
    marks real rows (1) against padding (0); `axis_name` names the data-parallel axis
    that statistics are synchronised over, or is None on one device. `module`, where apply is
    a Flax module's apply with axis_name set, is that module, for a capability that swaps
    its layer types.
    """
    init: Callable[[jax.Array], tuple[Any, Any]]
    apply: Callable[..., tuple[jax.Array, Any]]
    module: Any = None


# ReLU as in the book; softplus is a kink-free stand-in for parity experiments: float32
# round-off can tip a ReLU input across zero on one device count and not on another.
ACTIVATIONS = {"relu": jax.nn.relu, "softplus": jax.nn.softplus}
ACTIVATION = Option("activation", "relu", tuple(ACTIVATIONS),
                    "relu (the book's), or softplus, which has no kink for round-off to tip a "
                    "unit across")
