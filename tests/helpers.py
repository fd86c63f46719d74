"""What the tests share: random batches, and SGD steps from seed 0 on any backend."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_dp import parity, train
from jax_dp.backends import make_backend
from jax_dp.devices import get_devices


def random_batches(n_steps, batch_size, size=28, dtype=np.float32, seed=0):
    """Batches of random size x size images with random labels, all real (mask 1)."""
    rng = np.random.default_rng(seed)
    return [{"image": rng.random((batch_size, size, size, 1)).astype(dtype),
             "label": rng.integers(0, 10, batch_size).astype(np.int32),
             "mask": np.ones(batch_size, dtype)} for _ in range(n_steps)]


def run_steps(model, backend, k, batches, *, lr, dtype=jnp.float32, **step_options):
    """SGD on k devices from seed 0's params (as dtype): placed state, host state, host metrics."""
    tx = optax.sgd(lr)
    steps = train.make_steps(model, tx, make_backend(backend, get_devices(k)), **step_options)
    b = steps.backend
    # On the host, so each backend places (and may donate) its own copy.
    init = jax.device_get(parity.cast(train.init_state(model, tx, jax.random.key(0)), dtype))
    state, metrics = b.replicate(init), b.replicate(train.zero_metrics())
    for batch in batches:
        state, metrics = steps.train_batch(state, metrics, b.shard(batch))
    return state, b.unreplicate(state), b.unreplicate(metrics)
