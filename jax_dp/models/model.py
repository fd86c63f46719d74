"""A model as (init, apply), two pure functions, so one train step serves every model."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax


class Model(NamedTuple):
    """init(key) -> (params, state); apply(params, state, x, mask, *, train, axis_name) -> (logits, state).

    `state` holds what training updates besides params (BatchNorm statistics); `mask`
    marks real rows (1) against padding (0); `axis_name` names the data-parallel axis
    that statistics are synchronised over, or is None on one device.
    """
    init: Callable[[jax.Array], tuple[Any, Any]]
    apply: Callable[..., tuple[jax.Array, Any]]
