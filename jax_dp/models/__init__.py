"""The models by name: each is a module that declares OPTIONS and make(**options) -> Model.

A model of your own is one more module like jax_dp/models/lenet.py: name it here for a short
name, or pass its import path ("my_package.my_model") wherever a model name is asked for.
Nothing here imports JAX or Flax until a model is asked for.
"""

from __future__ import annotations

import importlib
import math
from types import ModuleType

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


def model_options(name: str, options: dict | None = None, backend: str | None = None) -> dict:
    """Every option of the model called name, in its declared order: options over the defaults.
    An option it does not declare, a value it does not allow, or one its check(options,
    backend) refuses for this backend, is refused."""
    module = model_module(name)
    declared = {option.name: option for option in module.OPTIONS}
    for key, value in (options or {}).items():
        check_choice(f"{name} option", key, tuple(declared))
        check_choice(key, value, declared[key].choices)
    options = {key: (options or {}).get(key, option.default) for key, option in declared.items()}
    if backend is not None and hasattr(module, "check"):
        module.check(options, backend)
    return options


def auto_choices(name: str, options: dict, platform: str) -> dict:
    """What the model's 'auto' options stand for on platform (its module's optional auto())."""
    auto = getattr(model_module(name), "auto", None)
    return auto(options, platform) if auto else {}


def get_model(name: str, **options):
    """The Model called name, built with options (model_options fills in the defaults)."""
    return model_module(name).make(**model_options(name, options))


def model_bytes(name: str, **options) -> int:
    """Bytes of the model's params and state, found without starting JAX's backend."""
    return _bytes(_shapes(name, options))


def param_bytes(name: str, **options) -> int:
    """Bytes of the model's params alone: what a step all-reduces as gradients."""
    return _bytes(_shapes(name, options)[0])


def _shapes(name, options):
    import jax

    return jax.eval_shape(lambda: get_model(name, **options).init(jax.random.key(0)))


def _bytes(shapes) -> int:
    import jax

    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))
