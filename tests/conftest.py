"""8 simulated CPU devices, set up before any test touches JAX; shared data fixtures."""

import atexit
import os
import shutil
import tempfile

# Many tests compile the same small steps: JAX's persistent compilation cache, new for each
# session and shared with the experiments the tests start, compiles each program once.
# xdist's workers inherit the directory from the process that made it, which removes it at exit.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax-dp-test-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

from jax_dp import devices  # noqa: E402  (after the cache settings: JAX reads them on import)

NDEV = 8
devices.simulate_cpu_devices(NDEV)

import pytest  # noqa: E402

from jax_dp import data  # noqa: E402


@pytest.fixture(scope="session")
def fashion_train() -> data.Split:
    """The real training split, prepared once into the default TFDS data dir."""
    return data.load_fashion_mnist("train")


@pytest.fixture(scope="session")
def fashion_train_6k() -> data.Split:
    """The first 6,000 training examples: decoding all 60,000 takes seconds per worker."""
    return data.load_fashion_mnist("train", limit=6000)


@pytest.fixture(scope="session")
def fashion_test() -> data.Split:
    """The real test split."""
    return data.load_fashion_mnist("test")
