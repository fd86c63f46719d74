"""TrainConfig: every field validated with a message naming it, printed and compared whole."""

import dataclasses

import pytest

from jax_dp import models
from jax_dp.config import PLACEMENT, SIZES, TrainConfig
from jax_dp.errors import ParamError


@pytest.mark.parametrize("change,message", [
    ({"model": "vgg"}, "unknown model 'vgg': use one of lenet, resnet18, a module path"),
    ({"options": "conv=xla"}, "options must be a dict of the model's options, got 'conv=xla'"),
    ({"backend": "pjit"}, "unknown backend 'pjit': use one of pmap, shard_map, jit, single"),
    ({"allreduce": "tree"}, "unknown allreduce 'tree': use one of psum, star, ring"),
    ({"allreduce": "ring", "backend": "jit", "devices": 2},
     "allreduce ring is written for the pmap backend; use backend pmap"),
    ({"backend": "single", "devices": 2}, "backend single runs on one device, not 2: pass devices 1"),
    ({"devices": 0}, "devices must be at least 1, got 0"),
    ({"batch_size": 0}, "batch_size must be at least 1, got 0"),
    ({"batch_size": 2.5}, "batch_size must be at least 1, got 2.5"),
    ({"lr": float("nan")}, "lr must be a positive finite number, got nan"),
    ({"lr": -0.1}, "lr must be a positive finite number, got -0.1"),
    ({"warmup_epochs": -1.0}, "warmup_epochs must be 0 or more, got -1.0"),
    ({"epochs": 0}, "epochs must be at least 1, got 0"),
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


@pytest.mark.parametrize("model,options,backend,message", [
    ("lenet", {"conv": "fft"}, "pmap", "unknown conv 'fft': use one of auto, xla, im2col"),
    ("resnet18", {"bn": "global"}, "pmap", "unknown bn 'global': use one of sync, local"),
    ("lenet", {"activation": "tanh"}, "pmap", "unknown activation 'tanh': use one of relu, softplus"),
    ("lenet", {"bn": "sync"}, "pmap", "unknown lenet option 'bn': use one of conv, activation"),
    ("resnet18", {"bn": "local"}, "shard_map",
     "bn local keeps statistics per device, which only backend pmap can hold"),
    ("jax_dp.nowhere", {}, "pmap", "cannot import model 'jax_dp.nowhere'"),
    ("jax_dp.data", {}, "pmap", "model 'jax_dp.data' is not a model: its module needs OPTIONS"),
])
def test_a_bad_model_option_is_refused_by_the_models_declaration(model, options, backend, message):
    with pytest.raises(ParamError) as e:
        models.model_options(model, options, backend)
    assert message in str(e.value)


def test_model_options_are_the_declared_defaults_in_order_overridden_by_the_given():
    assert models.model_options("lenet") == {"conv": "auto", "activation": "relu", "conv_grads": "auto"}
    assert models.model_options("resnet18", {"activation": "softplus"}) == {
        "bn": "sync", "activation": "softplus", "conv_grads": "auto"}
    assert models.model_options("resnet18", {"bn": "local"}, "pmap")["bn"] == "local"


def test_a_convolution_choice_without_a_platform_is_refused_naming_make_model():
    """models.get_model convolves with XLA's own convolution unless given one: a conv_grads
    other than auto there would be silently lost."""
    with pytest.raises(ParamError, match=r"^conv_grads 'canonical' chooses the platform's "
                                         r"convolution: build the model with jax_dp\.assembly"):
        models.get_model("lenet", conv_grads="canonical")


def test_a_config_holds_its_models_options_checked_and_complete():
    """Checked once, here: the loop and the models below trust config.options."""
    assert TrainConfig(model="resnet18", options={"activation": "softplus"}).options == {
        "bn": "sync", "activation": "softplus", "conv_grads": "auto"}
    with pytest.raises(ParamError, match="bn local keeps statistics per device, which only "
                                         "backend pmap can hold"):
        TrainConfig(model="resnet18", options={"bn": "local"}, backend="shard_map")
    with pytest.raises(ParamError, match="unknown lenet option 'bn'"):
        TrainConfig(options={"bn": "sync"})


def test_a_config_is_frozen_and_prints_every_field_its_model_options_first():
    c = TrainConfig(model="resnet18", options={"bn": "sync", "activation": "relu"}, devices=2,
                    batch_size=512)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.lr = 1.0
    text = str(c)
    assert text.startswith("model=resnet18 bn=sync activation=relu conv_grads=auto backend=pmap")
    assert "devices=2 batch_size=512" in text and "conv=" not in text and "options" not in text


SAVED = TrainConfig(options={"conv": "auto", "activation": "relu", "conv_grads": "auto"}, epochs=2)
# A value unlike SAVED's for every field and model option.
OTHER = {"model": "resnet18", "backend": "jit", "allreduce": "ring", "devices": 2, "batch_size": 128,
         "lr": 0.1, "warmup_epochs": 1.0, "epochs": 1, "seed": 1, "exact": True, "drop_remainder": True,
         "train_examples": 1000, "test_examples": 100, "compute_dtype": "bfloat16"}


def test_every_field_has_a_differing_value_to_try():
    assert set(OTHER) | {"options"} == {f.name for f in dataclasses.fields(TrainConfig)}


@pytest.mark.parametrize("field", sorted(OTHER) + ["conv", "activation", "conv_grads"])
def test_a_resume_is_refused_for_a_change_of_any_field_or_model_option(field):
    """Catches any field exempted from the check (only a larger epochs may change)."""
    if field in OTHER:
        changed = dataclasses.replace(SAVED, **{field: OTHER[field]}, **(
            {"backend": "pmap"} if field == "allreduce" else {}),
            **({"options": {}} if field == "model" else {}))  # Another model, its own options.
    else:
        other = {"conv": "im2col", "activation": "softplus", "conv_grads": "xla"}[field]
        changed = dataclasses.replace(SAVED, options={**SAVED.options, field: other})
    want = {field: (SAVED.fields()[field], changed.fields()[field])}
    fixed = PLACEMENT if field in PLACEMENT else ()  # Placement changes only where fixed.
    assert changed.differences(dataclasses.asdict(SAVED), fixed) == want  # That field, and only it.
    if field in PLACEMENT:
        assert changed.differences(dataclasses.asdict(SAVED)) == {}


def test_a_resume_may_only_add_epochs():
    saved = dataclasses.asdict(SAVED)
    assert SAVED.differences(saved) == {}
    assert dataclasses.replace(SAVED, epochs=5).differences(saved) == {}
    assert dataclasses.replace(SAVED, epochs=1).differences(saved) == {"epochs": (2, 1)}


def test_a_checkpoint_without_a_field_is_another_run():
    """No field is assumed at its default: a checkpoint that lacks one is refused, naming it."""
    saved = {k: v for k, v in dataclasses.asdict(SAVED).items() if k != "compute_dtype"}
    assert SAVED.differences(saved) == {"compute_dtype": (None, "float32")}
