"""One collective per step: the gradients and metrics all-reduced as one flat buffer, with the
same sums as one all-reduce per array."""

import functools
import sys

import jax
import numpy as np
import optax
import pytest
from jax import lax

from jax_dp import assembly, parallel, program, step as step_lib
from jax_dp.backends import make_backend
from jax_dp.devices import get_devices

sys.path.insert(0, "tests")
import tiny_resnet  # noqa: E402

MODELS = {"lenet": assembly.make_model("lenet"), "tiny_resnet": tiny_resnet.make()}
# BatchNorm's statistics: one all-reduce forward and one backward per layer, each needed before
# the step can go on; tests/tiny_resnet.py has 5 BatchNorm layers.
BATCH_NORM_REDUCES = {"lenet": 0, "tiny_resnet": 10}


def all_reduce_operands(backend, model):
    """The operand shapes of each all-reduce in the compiled step, for 2 devices."""
    tx = optax.sgd(0.1)
    built = assembly.build(model, tx, backend, get_devices(2))
    b = built.backend
    batch = b.shard({"image": np.zeros((8, 28, 28, 1), np.float32), "label": np.zeros(8, np.int32),
                     "mask": np.ones(8, np.float32)})
    hlo = built.lower("train", b.replicate(step_lib.init_state(model, tx, jax.random.key(0))),
                      b.replicate(step_lib.zero_metrics()), batch).compile().as_text()
    return [line.split(" = ")[1].split(" all-reduce")[0] for line in hlo.splitlines()
            if " all-reduce(" in line or " all-reduce-start(" in line]


@pytest.mark.parametrize("backend", ["pmap", "shard_map"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_step_all_reduces_its_gradients_and_metrics_as_one_buffer(backend, name):
    """Catches a step that sums each gradient array on its own (a tuple of operands)."""
    reduces = all_reduce_operands(backend, MODELS[name])
    n_params = sum(leaf.size for leaf in jax.tree.leaves(MODELS[name].init(jax.random.key(0))[0]))
    flat = f"f32[{n_params + 3}]{{0}}"  # Every gradient, then the loss sum, correct and count.
    assert reduces.count(flat) == 1
    assert len(reduces) == 1 + BATCH_NORM_REDUCES[name]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_buffer_gives_the_bits_of_one_all_reduce_per_array(name, fashion_train_6k):
    """Over 2 devices each sum has two terms, so the bits must be equal after 5 steps."""
    model, tx = MODELS[name], optax.sgd(0.1, momentum=0.9)
    per_array = functools.partial(step_lib.train_step, model=model, tx=tx, axis_name=parallel.AXIS,
                                  grad_allreduce=lambda tree, axis: lax.psum(tree, axis))
    backend = make_backend("pmap", get_devices(2))
    runs = []
    for steps in (step_lib.make_steps(model, tx, parallel.AXIS), step_lib.Steps(per_array)):
        run = program.Program(backend, steps)
        state, metrics = run.place(step_lib.init_state(model, tx, jax.random.key(0)))
        for i in range(5):
            batch = {"image": fashion_train_6k.images[i * 32:(i + 1) * 32],
                     "label": fashion_train_6k.labels[i * 32:(i + 1) * 32], "mask": np.ones(32, np.float32)}
            state, metrics = run.train(state, metrics, backend.shard(batch))
        runs.append([np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(
            backend.unreplicate((state, metrics)))])
    assert runs[0] == runs[1]

