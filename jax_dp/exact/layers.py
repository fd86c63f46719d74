"""A Flax model's layers on micro-batches: each micro-batch through each layer alone, each weight's
gradient and each batch statistic summed in the exact mode's tree."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import flax.linen as nn
from jax import lax

from jax_dp.exact.batch_norm import BatchNorm
from jax_dp.exact.micro import Parts, layer
from jax_dp.models.model import Model


class Conv(nn.Module):
    """flax.linen.Conv's params and values (NHWC, HWIO) on Parts."""
    features: int
    kernel_size: Sequence[int]
    strides: int = 1
    padding: int | str = "SAME"
    use_bias: bool = True
    kernel_init: Callable = nn.initializers.lecun_normal()
    conv_general_dilated: Callable = lax.conv_general_dilated

    @nn.compact
    def __call__(self, x: Parts) -> Parts:
        weights = [self.param("kernel", self.kernel_init,
                              (*self.kernel_size, x.shape[-1], self.features))]
        if self.use_bias:
            weights.append(self.param("bias", nn.initializers.zeros, (self.features,)))
        padding = self.padding if isinstance(self.padding, str) else [(self.padding,) * 2] * 2
        return layer(partial(_conv, strides=(self.strides,) * 2, padding=padding,
                             convolution=self.conv_general_dilated), x, *weights)


def _conv(x, kernel, bias=None, *, strides, padding, convolution):
    y = convolution(x.astype(kernel.dtype), kernel, strides, padding,  # In the weights' dtype.
                    dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y if bias is None else y + bias.reshape(1, 1, 1, -1)


class Dense(nn.Module):
    """flax.linen.Dense's params and values on Parts."""
    features: int
    kernel_init: Callable = nn.initializers.lecun_normal()

    @nn.compact
    def __call__(self, x: Parts) -> Parts:
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features))
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        return layer(_dense, x, kernel, bias)


def _dense(x, kernel, bias):
    x = x.astype(kernel.dtype)
    return lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ()))) + bias.reshape(1, -1)


def on_micro_batches(model: Model, n: int) -> Model:
    """model, its Flax module's layer types (conv, dense, norm, act) swapped for ones that run each
    of n micro-batches alone: apply cuts x and mask into n micro-batches, logits come back whole."""
    act: Any = model.module.act

    def apply(params, state, x, mask, *, train, axis_name):
        module = model.module.clone(conv=Conv, dense=Dense, norm=BatchNorm, axis_name=axis_name,
                                    act=lambda x: x.map(act))
        variables = {"params": params, "batch_stats": state}
        x, mask = Parts.split(x, n), Parts.split(mask, n)
        if not train:
            return module.apply(variables, x, mask, train=False).rows(), state
        logits, updates = module.apply(variables, x, mask, train=True, mutable=["batch_stats"])
        return logits.rows(), updates["batch_stats"]

    return Model(model.init, apply, model.module)
