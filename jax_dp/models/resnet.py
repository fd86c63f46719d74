"""The book's small-input ResNet-18 in Flax linen, its BatchNorm synchronised over devices."""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jax_dp import micro
from jax_dp.conv import conv, resolve_grads
from jax_dp.errors import ParamError
from jax_dp.models.batch_norm import normalize
from jax_dp.models.model import ACTIVATION, ACTIVATIONS, CONV_GRADS, Model, Option

# The book's initialisation, Normal(0, 0.01) for every convolution and dense weight,
# biases zero; BatchNorm after each convolution keeps the signal alive despite the scale.
conv_init = nn.initializers.normal(0.01)


class Conv(nn.Module):
    """flax.linen.Conv's params and values (NHWC, HWIO) from jax_dp.conv; x an array, or a
    list of micro-batches (the exact mode: jax_dp.micro.layer)."""
    features: int
    kernel_size: tuple[int, int]
    strides: int = 1
    padding: int | str = "SAME"
    use_bias: bool = True
    grads: str = "auto"  # How convolution gradients are written (jax_dp.conv.GRADS).

    @nn.compact
    def __call__(self, x):
        weights = [self.param("kernel", conv_init,
                              (*self.kernel_size, micro.part(x).shape[-1], self.features))]
        if self.use_bias:
            weights.append(self.param("bias", nn.initializers.zeros, (self.features,)))
        padding = self.padding if isinstance(self.padding, str) else [(self.padding,) * 2] * 2
        return micro.layer(partial(_conv, strides=(self.strides,) * 2, padding=padding,
                                   grads=self.grads), x, *weights)


def _conv(x, kernel, bias=None, *, strides, padding, grads):
    y = conv(x.astype(kernel.dtype), kernel, strides, padding, grads)  # In the weights' dtype.
    return y if bias is None else y + bias.reshape(1, 1, 1, -1)


class Dense(nn.Module):
    """flax.linen.Dense's params and values; x an array, or a list of micro-batches."""
    features: int

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", conv_init, (micro.part(x).shape[-1], self.features))
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        return micro.layer(_dense, x, kernel, bias)


def _dense(x, kernel, bias):
    x = x.astype(kernel.dtype)
    return lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ()))) + bias.reshape(1, -1)


# A convolution followed by BatchNorm gets no bias: BatchNorm subtracts the mean, so such a
# bias has an exactly zero gradient and would hold only round-off noise (the book keeps it).
conv_bn = partial(Conv, use_bias=False)


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
        features = micro.part(x).shape[-1]
        scale = self.param("scale", nn.initializers.ones, (features,))
        bias = self.param("bias", nn.initializers.zeros, (features,))
        running_mean = self.variable("batch_stats", "mean", jnp.zeros, (features,))
        running_var = self.variable("batch_stats", "var", jnp.ones, (features,))
        dtype = micro.part(x).dtype  # Statistics in float32 at least, the output in x's dtype.
        x = micro.apply(lambda x: x.astype(jnp.promote_types(dtype, jnp.float32)), x)
        if not train:
            return micro.apply(lambda x: ((x - running_mean.value) * jax.lax.rsqrt(
                running_var.value + self.epsilon) * scale + bias).astype(dtype), x)
        y, mean, var = normalize(x, mask, scale.astype(micro.part(x).dtype),
                                 bias.astype(micro.part(x).dtype), self.axis_name, self.epsilon)
        if not self.is_initializing():
            running_mean.value = self.momentum * running_mean.value + (1 - self.momentum) * mean
            running_var.value = self.momentum * running_var.value + (1 - self.momentum) * var
        return micro.apply(lambda y: y.astype(dtype), y)


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
        conv3 = partial(conv_bn, self.channels, (3, 3), padding=1, grads=self.grads)
        y = micro.apply(self.act, norm()(conv3(strides=self.strides)(x), mask, train))
        y = norm()(conv3()(y), mask, train)
        if self.use_1x1conv:
            x = Conv(self.channels, (1, 1), self.strides, grads=self.grads)(x)
        return micro.apply(lambda y, x: self.act(y + x), y, x)


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
        x = conv_bn(self.stage_channels[0], (3, 3), padding=1, grads=self.grads)(x)
        x = micro.apply(self.act, BatchNorm(self.axis_name)(x, mask, train))
        for stage, channels in enumerate(self.stage_channels):
            for block in range(self.blocks_per_stage):
                downsample = stage > 0 and block == 0
                x = Residual(channels, strides=2 if downsample else 1, use_1x1conv=downsample,
                             axis_name=self.axis_name, act=self.act, grads=self.grads)(x, mask, train)
        x = micro.apply(partial(jnp.mean, axis=(1, 2)), x)  # Global average pool.
        return Dense(self.num_classes)(x)


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


micro_batches = micro.split  # (make's apply names its argument micro.)


def _rows(logits):
    return jnp.concatenate(logits) if isinstance(logits, list) else logits


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

    def apply(params, state, x, mask, *, train, axis_name, micro=None):
        module = ResNet(stage_channels, blocks_per_stage, num_classes, act=act, grads=conv_grads,
                        axis_name=axis_name if bn == "sync" else None)
        variables = {"params": params, "batch_stats": state}
        if micro is not None:  # The exact mode: every activation a list of micro-batches.
            x, mask = micro_batches(x, micro), micro_batches(mask, micro)
        if not train:
            return _rows(module.apply(variables, x, mask, train=False)), state
        logits, updates = module.apply(variables, x, mask, train=True, mutable=["batch_stats"])
        return _rows(logits), updates["batch_stats"]

    return Model(init, apply, micro=bn == "sync")
