"""TrainConfig: every field validated with a message naming it, printed and compared whole."""

import dataclasses

import pytest

from jax_dp.config import SIZES, TrainConfig
from jax_dp.errors import ParamError


@pytest.mark.parametrize("change,message", [
    ({"model": "vgg"}, "unknown model 'vgg': use one of lenet, resnet18"),
    ({"conv": "fft"}, "unknown conv 'fft': use one of xla, im2col, auto"),
    ({"model": "resnet18", "bn": "global"}, "unknown bn 'global': use one of sync, local"),
    ({"activation": "tanh"}, "unknown activation 'tanh': use one of relu, softplus"),
    ({"backend": "pjit"}, "unknown backend 'pjit': use one of pmap, shard_map, jit, single"),
    ({"allreduce": "tree"}, "unknown allreduce 'tree': use one of psum, star, ring"),
    ({"allreduce": "ring", "backend": "jit", "devices": 2},
     "allreduce ring is written for the pmap backend; use backend pmap"),
    ({"model": "resnet18", "bn": "local", "backend": "shard_map"},
     "bn local keeps statistics per device, which only backend pmap can hold"),
    ({"backend": "single", "devices": 2}, "backend single runs on one device, not 2: pass devices 1"),
    ({"devices": 0}, "devices must be at least 1, got 0"),
    ({"batch_size": 0}, "batch_size must be at least 1, got 0"),
    ({"batch_size": 2.5}, "batch_size must be at least 1, got 2.5"),
    ({"lr": float("nan")}, "lr must be a positive finite number, got nan"),
    ({"lr": -0.1}, "lr must be a positive finite number, got -0.1"),
    ({"warmup_epochs": -1.0}, "warmup_epochs must be 0 or more, got -1.0"),
    ({"epochs": 0}, "epochs must be at least 1, got 0"),
    ({"data": "web"}, "unknown data 'web': use one of debian, tfds"),
    ({"train_examples": 0}, "train_examples must be at least 1, got 0"),
    ({"train_examples": 100_000},
     "train_examples 100000 is more than the 60,000 train images of Fashion-MNIST: pass 60000 or fewer"),
    ({"test_examples": 10_001}, "test_examples 10001 is more than the 10,000 test images"),
])
def test_a_bad_field_is_refused_naming_it(change, message):
    with pytest.raises(ParamError) as e:
        TrainConfig(**change)
    assert message in str(e.value)
    # The same message with the CLI's spelling of every name it mentions:
    flags = e.value.spelled(lambda name: "--" + name.replace("_", "-"))
    assert all(("--" + p.replace("_", "-")) in flags for p in e.value.params)


def test_defaults_are_the_books_lenet_run_on_all_of_fashion_mnist():
    c = TrainConfig()
    assert (c.model, c.batch_size, c.lr, c.train_examples, c.test_examples) == (
        "lenet", 256, 0.2, SIZES["train"], SIZES["test"])


def test_a_config_is_frozen_and_prints_every_field_its_model_uses():
    c = TrainConfig(model="resnet18", devices=2, batch_size=512)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.lr = 1.0
    text = str(c)
    assert text.startswith("model=resnet18 bn=sync activation=relu backend=pmap")
    assert "devices=2 batch_size=512" in text and "conv=" not in text
    assert "conv=auto" in str(TrainConfig()) and "bn=" not in str(TrainConfig())
    assert c.model_options() == {"bn": "sync", "activation": "relu"}


def test_resume_conflict_allows_only_more_epochs():
    saved = dataclasses.asdict(TrainConfig(epochs=2))
    assert TrainConfig(epochs=2).resume_conflict(saved) is None
    assert TrainConfig(epochs=5).resume_conflict(saved) is None
    assert TrainConfig(epochs=1).resume_conflict(saved) == "epochs"
    for field, value in [("conv", "xla"), ("activation", "softplus"), ("allreduce", "ring"),
                         ("test_examples", 100), ("data", "tfds"), ("seed", 1), ("lr", 0.1)]:
        assert TrainConfig(epochs=2, **{field: value}).resume_conflict(saved) == field
    assert TrainConfig().resume_conflict({**saved, "bn": "local"}) == "bn"
