"""The book's small-input ResNet-18 in Flax linen, its BatchNorm synchronised over devices."""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_dp.conv import flax_conv, resolve_grads
from jax_dp.errors import ParamError
from jax_dp.models.batch_norm import normalize
from jax_dp.models.model import ACTIVATION, ACTIVATIONS, CONV_GRADS, Model, Option

# The book's initialisation, Normal(0, 0.01) for every convolution and dense weight,
# biases zero; BatchNorm after each convolution keeps the signal alive despite the scale.
conv_init = nn.initializers.normal(0.01)
# A convolution followed by BatchNorm gets no bias: BatchNorm subtracts the mean, so such a
# bias has an exactly zero gradient and would hold only round-off noise (the book keeps it).
conv_bn = partial(nn.Conv, use_bias=False, kernel_init=conv_init)


class BatchNorm(nn.Module):
    """BatchNorm whose training statistics cover the real rows of the whole global batch.

    In training, per-channel sums of x and x^2 over the rows with mask 1 are summed over
    `axis_name` (one all-reduce), so k devices normalise with exactly the statistics one
    device would compute on the global batch, and padded rows are ignored. With
    axis_name None each device uses its own shard's statistics (the book's behaviour).
    Running averages: r <- momentum * r + (1 - momentum) * batch statistic.
    """
    axis_name: str | None = None
    momentum: float = 0.9
    epsilon: float = 1e-5

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array, train: bool) -> jax.Array:
        features = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (features,))
        bias = self.param("bias", nn.initializers.zeros, (features,))
        running_mean = self.variable("batch_stats", "mean", jnp.zeros, (features,))
        running_var = self.variable("batch_stats", "var", jnp.ones, (features,))
        if not train:
            return (x - running_mean.value) * jax.lax.rsqrt(running_var.value + self.epsilon) \
                * scale + bias
        y, mean, var = normalize(x, mask, scale, bias, self.axis_name, self.epsilon)
        if not self.is_initializing():
            running_mean.value = self.momentum * running_mean.value + (1 - self.momentum) * mean
            running_var.value = self.momentum * running_var.value + (1 - self.momentum) * var
        return y


class Residual(nn.Module):
    """The book's residual block: two 3x3 convolutions, each with BatchNorm, and a shortcut."""
    channels: int
    strides: int = 1
    use_1x1conv: bool = False
    axis_name: str | None = None
    act: Callable = nn.relu
    grads: str = "auto"  # How convolution gradients are written (jax_dp.conv.GRADS).

    @nn.compact
    def __call__(self, x, mask, train):
        norm = partial(BatchNorm, axis_name=self.axis_name)
        convolve = partial(flax_conv, grads=self.grads)
        y = conv_bn(self.channels, (3, 3), self.strides, padding=1, conv_general_dilated=convolve)(x)
        y = self.act(norm()(y, mask, train))
        y = norm()(conv_bn(self.channels, (3, 3), padding=1, conv_general_dilated=convolve)(y),
                   mask, train)
        if self.use_1x1conv:
            x = nn.Conv(self.channels, (1, 1), self.strides, kernel_init=conv_init,
                        conv_general_dilated=convolve)(x)
        return self.act(y + x)


class ResNet(nn.Module):
    """Small-input ResNet: 3x3 stem with stride 1 and no max-pool, then residual stages."""
    stage_channels: Sequence[int] = (64, 128, 256, 512)
    blocks_per_stage: int = 2
    num_classes: int = 10
    axis_name: str | None = None
    act: Callable = nn.relu
    grads: str = "auto"  # How convolution gradients are written (jax_dp.conv.GRADS).

    @nn.compact
    def __call__(self, x, mask, train):
        x = conv_bn(self.stage_channels[0], (3, 3), padding=1,
                    conv_general_dilated=partial(flax_conv, grads=self.grads))(x)
        x = self.act(BatchNorm(self.axis_name)(x, mask, train))
        for stage, channels in enumerate(self.stage_channels):
            for block in range(self.blocks_per_stage):
                downsample = stage > 0 and block == 0
                x = Residual(channels, strides=2 if downsample else 1, use_1x1conv=downsample,
                             axis_name=self.axis_name, act=self.act, grads=self.grads)(x, mask, train)
        x = jnp.mean(x, axis=(1, 2))  # Global average pool.
        return nn.Dense(self.num_classes, kernel_init=conv_init)(x)


ResNet18 = partial(ResNet, stage_channels=(64, 128, 256, 512), blocks_per_stage=2)

OPTIONS = (
    Option("bn", "sync", ("sync", "local"),
           "BatchNorm statistics of the global batch (sync) or of each device's shard "
           "(local, the book's)"),
    ACTIVATION,
    CONV_GRADS,
)
# The YNNPACK fusion set (xla_options.FUSIONS) measured fastest on XLA:CPU (docs/speed.md).
CPU_FUSION = "ynn-noconv"


def check(options: dict, backend: str) -> None:
    """Refuse per-device statistics on a backend that keeps one copy of the model state."""
    if options["bn"] == "local" and backend not in ("pmap", "single"):
        raise ParamError(("bn", "backend"), "{} local keeps statistics per device, which only "
                         "{} pmap can hold; use it")


def auto(options: dict, platform: str) -> dict:
    """What each 'auto' option of options stands for on platform."""
    return {"conv_grads": resolve_grads("auto", platform)} if options.get("conv_grads") == "auto" else {}


def make(bn: str = "sync", activation: str = "relu", conv_grads: str = "auto",
         num_classes: int = 10, stage_channels: Sequence[int] = (64, 128, 256, 512),
         blocks_per_stage: int = 2) -> Model:
    """ResNet-18 as a Model (OPTIONS: bn 'sync' uses global-batch statistics, 'local' per-device
    ones); stage_channels and blocks_per_stage give a smaller ResNet of the same code."""
    act = ACTIVATIONS[activation]

    def init(key):
        variables = ResNet(stage_channels, blocks_per_stage, num_classes, act=act).init(
            key, jnp.zeros((1, 28, 28, 1)), jnp.ones(1), train=False)
        return variables["params"], variables["batch_stats"]

    def apply(params, state, x, mask, *, train, axis_name):
        module = ResNet(stage_channels, blocks_per_stage, num_classes, act=act, grads=conv_grads,
                        axis_name=axis_name if bn == "sync" else None)
        variables = {"params": params, "batch_stats": state}
        if not train:
            return module.apply(variables, x, mask, train=False), state
        logits, updates = module.apply(variables, x, mask, train=True, mutable=["batch_stats"])
        return logits, updates["batch_stats"]

    return Model(init, apply)
