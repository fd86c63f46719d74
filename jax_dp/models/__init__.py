"""The models, by name, each as a Model of two pure functions."""

from __future__ import annotations

from jax_dp.models.lenet import init_lenet, lenet
from jax_dp.models.model import Model
from jax_dp.models.resnet import resnet18


def _lenet_apply(params, state, x, mask, *, train, axis_name):
    return lenet(params, x), state


LENET = Model(init=lambda key: (init_lenet(key), {}), apply=_lenet_apply)

MODELS = {"lenet": lambda: LENET, "resnet18": resnet18}


def get_model(name: str, **options) -> Model:
    """The model called name ('lenet', or 'resnet18' with bn='sync'|'local')."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: use one of {', '.join(sorted(MODELS))}")
    return MODELS[name](**options)
