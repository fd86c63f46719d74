"""Models as (init, apply) pairs of pure functions, so one train step serves them all."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax

from jax_dp.models.lenet import init_lenet, lenet


class Model(NamedTuple):
    """init(key) -> (params, state); apply(params, state, x, mask, *, train, axis_name) -> (logits, state).

    `state` holds what training updates besides params (BatchNorm statistics); `mask`
    marks real rows (1) against padding (0); `axis_name` names the data-parallel axis
    that statistics are synchronised over, or is None on one device.
    """
    init: Callable[[jax.Array], tuple[Any, Any]]
    apply: Callable[..., tuple[jax.Array, Any]]


def _lenet_apply(params, state, x, mask, *, train, axis_name):
    return lenet(params, x), state


LENET = Model(init=lambda key: (init_lenet(key), {}), apply=_lenet_apply)

MODELS = {"lenet": lambda **_: LENET}


def get_model(name: str, **options) -> Model:
    """The model called name ('lenet', 'resnet18')."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: use one of {', '.join(sorted(MODELS))}")
    return MODELS[name](**options)
