"""The models by name: each is a module that declares OPTIONS and make(**options) -> Model.

A model of your own is one more module like jax_dp/models/lenet.py: name it here for a short
name, or pass its import path ("my_package.my_model") wherever a model name is asked for.
Nothing here imports JAX or Flax until a model is asked for.
"""

from __future__ import annotations

import importlib
import inspect
import math
from types import ModuleType
from typing import NamedTuple

from jax_dp.errors import ParamError, check_choice

MODELS = {"lenet": "jax_dp.models.lenet", "resnet18": "jax_dp.models.resnet"}


def model_module(name: str) -> ModuleType:
    """The module of the model called name: a name in MODELS, or an import path."""
    if name not in MODELS and "." not in name:
        check_choice("model", name, tuple(MODELS) + ("a module path",))
    try:
        module = importlib.import_module(MODELS.get(name, name))
    except ImportError as e:
        raise ParamError("model", f"cannot import {{}} {name!r} ({e}): pass one of "
                         f"{', '.join(MODELS)} or an importable module") from None
    if not (hasattr(module, "OPTIONS") and hasattr(module, "make")):
        raise ParamError("model", f"{{}} {name!r} is not a model: its module needs OPTIONS "
                         "and make(**options)")
    return module


class Option(NamedTuple):
    """An option a model module declares: the command lines make it a flag --name."""
    name: str
    default: str
    choices: tuple[str, ...]
    help: str


# The option of every model whose make takes a `convolution`: how its gradients are written.
# jax_dp.assembly.make_model reads it to give the model its platform's convolution (jax_dp.xla_cpu).
CONV_GRADS = Option("conv_grads", "auto", ("auto", "canonical", "xla"),
                    "convolution gradients as canonical forward convolutions (measured faster on "
                    "XLA:CPU) or XLA's own; auto: canonical on CPU, XLA's own elsewhere")


def declared(module: ModuleType) -> tuple[Option, ...]:
    """The options of a model module: its OPTIONS, and CONV_GRADS where it convolves."""
    convolves = "convolution" in inspect.signature(module.make).parameters
    return tuple(module.OPTIONS) + ((CONV_GRADS,) if convolves else ())


def model_options(name: str, options: dict | None = None, backend: str | None = None) -> dict:
    """Every option of the model called name, in its declared order: options over the defaults.
    An option it does not declare, a value it does not allow, or one its check(options,
    backend) refuses for this backend, is refused."""
    module = model_module(name)
    declared_options = {option.name: option for option in declared(module)}
    for key, value in (options or {}).items():
        check_choice(f"{name} option", key, tuple(declared_options))
        check_choice(key, value, declared_options[key].choices)
    options = {key: (options or {}).get(key, option.default)
               for key, option in declared_options.items()}
    if backend is not None and hasattr(module, "check"):
        module.check(options, backend)
    return options


def per_device_state(name: str, options: dict) -> bool:
    """Whether the model called name keeps a state of its own on each device with these options
    (all of them, as TrainConfig holds them): its module's per_device_state(options), or False."""
    return bool(getattr(model_module(name), "per_device_state", lambda options: False)(options))


def get_model(name: str, convolution=None, **options):
    """The Model called name, built with options (checked already: TrainConfig or
    model_options), the defaults filled in. A model that convolves does so with convolution
    (XLA's own where None); jax_dp.assembly.make_model turns its conv_grads option into its
    platform's convolution."""
    module = model_module(name)
    options = {**{option.name: option.default for option in declared(module)}, **options}
    if "conv_grads" in options:
        grads = options.pop("conv_grads")
        if convolution is None and grads != "auto":
            raise ParamError("conv_grads", f"{{}} {grads!r} chooses the platform's convolution: "
                             "build the model with jax_dp.assembly.make_model")
        if convolution is not None:
            options["convolution"] = convolution
    return module.make(**options)


def param_bytes(name: str, **options) -> int:
    """Bytes of the model's params alone: what a step all-reduces as gradients."""
    return _bytes(_shapes(name, options)[0])


def _shapes(name, options):
    import jax

    # Any convolution gives the same shapes; none named keeps JAX's backend from starting.
    options = {k: v for k, v in options.items() if k != "conv_grads"}
    return jax.eval_shape(lambda: get_model(name, **options).init(jax.random.key(0)))


def _bytes(shapes) -> int:
    import jax

    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))
