"""8 simulated CPU devices, set up before any test touches JAX; shared data fixtures."""

from jax_dp import devices

NDEV = 8
devices.simulate_cpu_devices(NDEV)

import jax  # noqa: E402
import pytest  # noqa: E402

from jax_dp import data  # noqa: E402



@pytest.fixture(scope="session")
def fashion_train() -> data.Split:
    """The real training split, prepared once into the default TFDS data dir."""
    return data.load_fashion_mnist("train")


@pytest.fixture(scope="session")
def fashion_test() -> data.Split:
    """The real test split."""
    return data.load_fashion_mnist("test")
