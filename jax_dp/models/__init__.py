"""The models, by name, each as a Model of two pure functions."""

from __future__ import annotations

import math

import jax

from jax_dp.errors import ParamError
from jax_dp.models.lenet import CONVS, init_lenet, lenet, lenet_model
from jax_dp.models.model import ACTIVATIONS, Model
from jax_dp.models.resnet import BN_MODES, resnet18

MODELS = {"lenet": lenet_model, "resnet18": resnet18}
# The options each model's factory takes, and the values each option allows.
MODEL_OPTIONS = {"lenet": ("conv", "activation"), "resnet18": ("bn", "activation")}
OPTION_CHOICES = {"conv": tuple(CONVS), "bn": BN_MODES, "activation": tuple(ACTIVATIONS)}


def get_model(name: str, **options) -> Model:
    """The model called name: 'lenet' (conv=...) or 'resnet18' (bn=...), each with activation=..."""
    if name not in MODELS:
        raise ParamError("model", f"unknown {{}} {name!r}: use one of {', '.join(MODELS)}")
    return MODELS[name](**options)


def model_bytes(name: str, **options) -> int:
    """Bytes of the model's params and state, found without starting JAX's backend."""
    return _bytes(jax.eval_shape(lambda: get_model(name, **options).init(jax.random.key(0))))


def param_bytes(name: str, **options) -> int:
    """Bytes of the model's params alone: what a step all-reduces as gradients."""
    return _bytes(jax.eval_shape(lambda: get_model(name, **options).init(jax.random.key(0)))[0])


def _bytes(shapes) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))
