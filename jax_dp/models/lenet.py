"""The book's LeNet as a pure function over a params pytree."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_dp.models.model import ACTIVATION, ACTIVATIONS, Model, Option

Params = dict[str, dict[str, jax.Array]]

# (name, weight shape): convolutions HWIO over NHWC images, dense layers [in, out].
SHAPES = (
    ("conv1", (3, 3, 1, 20)),
    ("conv2", (5, 5, 20, 50)),
    ("fc1", (800, 128)),
    ("fc2", (128, 10)),
)


def init_lenet(key: jax.Array, scale: float = 0.01) -> Params:
    """Weights ~ Normal(0, scale), biases zero, as in the book."""
    keys = jax.random.split(key, len(SHAPES))
    return {name: {"w": scale * jax.random.normal(k, shape, jnp.float32),
                   "b": jnp.zeros(shape[-1], jnp.float32)}
            for k, (name, shape) in zip(keys, SHAPES)}


def conv2d(x: jax.Array, layer: dict, convolution=lax.conv_general_dilated) -> jax.Array:
    """A valid, stride-1 convolution of NHWC images with HWIO weights, plus bias."""
    y = convolution(x, layer["w"], (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y + layer["b"]


def conv2d_im2col(x: jax.Array, layer: dict) -> jax.Array:
    """The same convolution as one matrix product over stacked shifted windows (im2col).

    Each output pixel's kh x kw x C input window becomes one row; the weights become a
    (kh kw C) x O matrix, so its gradients are plain matrix products too.
    """
    kh, kw, c, o = layer["w"].shape
    h, w = x.shape[1] - kh + 1, x.shape[2] - kw + 1
    windows = jnp.concatenate([x[:, i:i + h, j:j + w] for i in range(kh) for j in range(kw)], -1)
    return windows @ layer["w"].reshape(kh * kw * c, o) + layer["b"]


def _avg_pool(x):
    """2x2 average pooling, stride 2 (an odd last row or column dropped), as a reshape and a sum:
    on XLA:CPU a fusion, where lax.reduce_window and its gradient take 1.15x the step."""
    n, h, w, c = x.shape
    return x[:, :h // 2 * 2, :w // 2 * 2].reshape(n, h // 2, 2, w // 2, 2, c).sum((2, 4)) / 4.0


def lenet(params: Params, X: jax.Array, convolve=conv2d, act=jax.nn.relu) -> jax.Array:
    """Logits [B, 10] for images X [B, 28, 28, 1]; convolve is conv2d or conv2d_im2col, act the ReLU."""
    h = _avg_pool(act(convolve(X, params["conv1"])))          # [B, 13, 13, 20]
    h = _avg_pool(act(convolve(h, params["conv2"])))          # [B, 4, 4, 50]
    h = h.reshape(h.shape[0], -1)                             # [B, 800]
    h = act(h @ params["fc1"]["w"] + params["fc1"]["b"])
    return h @ params["fc2"]["w"] + params["fc2"]["b"]


CONVS = {"xla": conv2d, "im2col": conv2d_im2col}
OPTIONS = (
    Option("conv", "auto", ("auto", *CONVS),
           "convolution: lax.conv ('xla', the readable one, and auto's choice), or one matrix "
           "product per layer ('im2col')"),
    ACTIVATION,
)


def make(conv: str = "auto", activation: str = "relu",
         convolution=lax.conv_general_dilated) -> Model:
    """LeNet as a Model (OPTIONS); convolution: what conv2d convolves with."""
    convolve = CONVS["xla" if conv == "auto" else conv]
    if convolve is conv2d:
        convolve = functools.partial(conv2d, convolution=convolution)
    act = ACTIVATIONS[activation]

    def apply(params, state, x, mask, *, train, axis_name):
        return lenet(params, x, convolve, act), state

    return Model(init=lambda key: (init_lenet(key), {}), apply=apply)
