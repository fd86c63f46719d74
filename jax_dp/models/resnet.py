"""The book's small-input ResNet-18 in Flax linen, its BatchNorm synchronised over devices."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

from jax_dp.errors import ParamError
from jax_dp.models.batch_norm import BatchNorm
from jax_dp.models.model import ACTIVATION, ACTIVATIONS, Model, Option

ModuleDef = Any

# The book's initialisation, Normal(0, 0.01) for every convolution and dense weight,
# biases zero; BatchNorm after each convolution keeps the signal alive despite the scale.
conv_init = nn.initializers.normal(0.01)


class Residual(nn.Module):
    """The book's residual block: two 3x3 convolutions, each with BatchNorm, and a shortcut."""
    channels: int
    strides: int = 1
    use_1x1conv: bool = False
    conv: ModuleDef = nn.Conv
    norm: ModuleDef = BatchNorm
    act: Callable = nn.relu

    @nn.compact
    def __call__(self, x, mask, train):
        # A convolution followed by BatchNorm gets no bias: BatchNorm subtracts the mean, so such
        # a bias has a zero gradient and would hold only round-off noise.
        conv3 = partial(self.conv, self.channels, (3, 3), padding=1, use_bias=False)
        y = self.act(self.norm()(conv3(strides=self.strides)(x), mask, train))
        y = self.norm()(conv3()(y), mask, train)
        if self.use_1x1conv:
            x = self.conv(self.channels, (1, 1), self.strides)(x)
        return self.act(y + x)


class ResNet(nn.Module):
    """Small-input ResNet: 3x3 stem with stride 1 and no max-pool, then residual stages.

    conv, dense and norm are the layer types (Flax's Conv and Dense, the synchronised
    BatchNorm); convolution is what the convolutions call (lax.conv_general_dilated).
    """
    stage_channels: Sequence[int] = (64, 128, 256, 512)
    blocks_per_stage: int = 2
    num_classes: int = 10
    axis_name: str | None = None
    act: Callable = nn.relu
    conv: ModuleDef = nn.Conv
    dense: ModuleDef = nn.Dense
    norm: ModuleDef = BatchNorm
    convolution: Callable = lax.conv_general_dilated

    @nn.compact
    def __call__(self, x, mask, train):
        conv = partial(self.conv, kernel_init=conv_init, conv_general_dilated=self.convolution)
        norm = partial(self.norm, axis_name=self.axis_name)
        x = conv(self.stage_channels[0], (3, 3), padding=1, use_bias=False)(x)
        x = self.act(norm()(x, mask, train))
        for stage, channels in enumerate(self.stage_channels):
            for block in range(self.blocks_per_stage):
                downsample = stage > 0 and block == 0
                x = Residual(channels, strides=2 if downsample else 1, use_1x1conv=downsample,
                             conv=conv, norm=norm, act=self.act)(x, mask, train)
        x = x.mean(axis=(1, 2))  # Global average pool.
        return self.dense(self.num_classes, kernel_init=conv_init)(x)


OPTIONS = (
    Option("bn", "sync", ("sync", "local"),
           "BatchNorm statistics of the global batch (sync) or of each device's shard "
           "(local, the book's)"),
    ACTIVATION,
)


def check(options: dict, backend: str) -> None:
    """Refuse per-device statistics on a backend that keeps one copy of the model state."""
    if options["bn"] == "local" and backend not in ("pmap", "single"):
        raise ParamError(("bn", "backend"), "{} local keeps statistics per device, which only "
                         "{} pmap can hold; use it")


def per_device_state(options: dict) -> bool:
    """bn 'local' keeps each device's statistics: the device count is then part of the run."""
    return options["bn"] == "local"


def make(bn: str = "sync", activation: str = "relu", num_classes: int = 10,
         stage_channels: Sequence[int] = (64, 128, 256, 512), blocks_per_stage: int = 2,
         convolution: Callable = lax.conv_general_dilated) -> Model:
    """ResNet-18 as a Model (OPTIONS: bn 'sync' uses global-batch statistics, 'local' per-device
    ones); stage_channels and blocks_per_stage give a smaller ResNet of the same code."""
    module = ResNet(stage_channels, blocks_per_stage, num_classes, act=ACTIVATIONS[activation],
                    convolution=convolution)

    def init(key):
        variables = module.init(key, jnp.zeros((1, 28, 28, 1)), jnp.ones(1), train=False)
        return variables["params"], variables["batch_stats"]

    local = module.clone(norm=partial(BatchNorm, local=True))  # Each device's shard alone.

    def apply(params, state, x, mask, *, train, axis_name):
        net = module.clone(axis_name=axis_name) if bn == "sync" else local
        variables = {"params": params, "batch_stats": state}
        if not train:
            return net.apply(variables, x, mask, train=False), state
        logits, updates = net.apply(variables, x, mask, train=True, mutable=["batch_stats"])
        return logits, updates["batch_stats"]

    return Model(init, apply, module=module if bn == "sync" else None)
