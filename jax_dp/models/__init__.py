"""The models, by name, each as a Model of two pure functions."""

from __future__ import annotations

import jax

from jax_dp.models.lenet import conv2d, conv2d_im2col, init_lenet, lenet
from jax_dp.models.model import Model, get_activation
from jax_dp.models.resnet import resnet18


CONVS = {"xla": conv2d, "im2col": conv2d_im2col}


def _auto_conv(x, layer):
    # Chosen while tracing, when the backend is known: im2col wins on XLA:CPU only.
    return (conv2d_im2col if jax.default_backend() == "cpu" else conv2d)(x, layer)


def lenet_model(conv: str = "xla", activation: str = "relu") -> Model:
    """LeNet as a Model; conv 'xla' (lax.conv), 'im2col' (one matrix product, 2x faster on
    CPU) or 'auto' (im2col on CPU, lax.conv elsewhere); activation 'relu' or 'softplus'."""
    convs = {**CONVS, "auto": _auto_conv}
    if conv not in convs:
        raise ValueError(f"unknown --conv {conv!r}: use one of {', '.join(convs)}")
    act = get_activation(activation)

    def apply(params, state, x, mask, *, train, axis_name):
        return lenet(params, x, convs[conv], act), state

    return Model(init=lambda key: (init_lenet(key), {}), apply=apply)


LENET = lenet_model()

MODELS = {"lenet": lenet_model, "resnet18": resnet18}


def get_model(name: str, **options) -> Model:
    """The model called name: 'lenet' (conv=...) or 'resnet18' (bn=...), each with activation=..."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: use one of {', '.join(sorted(MODELS))}")
    return MODELS[name](**options)
