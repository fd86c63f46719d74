"""A two-layer perceptron: a model of one's own, in one file (docs/models.md)."""

import jax
import jax.numpy as jnp

from jax_dp.models.model import ACTIVATION, ACTIVATIONS, Model, Option

OPTIONS = (Option("hidden", "32", ("16", "32", "64"), "width of the hidden layer"), ACTIVATION)


def make(hidden: str = "32", activation: str = "relu") -> Model:
    """The perceptron as a Model: 784 -> hidden -> 10, no state."""
    width, act = int(hidden), ACTIVATIONS[activation]

    def init(key):
        k1, k2 = jax.random.split(key)
        return {"w1": 0.05 * jax.random.normal(k1, (784, width)), "b1": jnp.zeros(width),
                "w2": 0.05 * jax.random.normal(k2, (width, 10)), "b2": jnp.zeros(10)}, {}

    def apply(params, state, x, mask, *, train, axis_name):
        h = act(x.reshape(x.shape[0], -1) @ params["w1"] + params["b1"])
        return h @ params["w2"] + params["b2"], state

    return Model(init, apply)
