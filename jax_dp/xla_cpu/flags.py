"""XLA:CPU options: the YNNPACK fusion set each model trains with, and XLA_FLAGS merged with a
user's own."""

from __future__ import annotations

import importlib.util
import os
import re

YNN_FUSION = "--xla_cpu_experimental_ynn_fusion_type"
# The YNNPACK fusion sets tried: XLA's default, matrix products only, the default less convolutions.
FUSIONS = {"ynn-default": "", "ynn-dots": f"{YNN_FUSION}=individual_dot",
           "ynn-noconv": f"{YNN_FUSION}=-individual_convolution"}
# The set measured fastest for each model on XLA:CPU (docs/speed.md); others get XLA's default.
MODEL_FUSIONS = {"lenet": "ynn-dots", "resnet18": "ynn-noconv"}
# JAX's GPU plugins (jax[cuda12], jax[cuda13], jax[rocm]): installed, JAX picks the GPU first.
GPU_PLUGINS = ("xla_cuda12", "xla_cuda13", "xla_rocm")


def accelerator_expected(environ=os.environ) -> bool:
    """Whether JAX will run on an accelerator, told before its backend starts: JAX_PLATFORMS
    names one first, or (unset) a GPU plugin is installed."""
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() != "cpu"
    try:
        return any(importlib.util.find_spec(f"jax_plugins.{p}") for p in GPU_PLUGINS)
    except ModuleNotFoundError:  # No jax_plugins package: no plugin.
        return False


def flag_names(flags: str) -> set[str]:
    """The names of the flags in an XLA_FLAGS string ('--a=1 -b' -> {'a', 'b'})."""
    return set(re.findall(r"(?:^|\s)--?([A-Za-z_]\w*)", flags))


def without(flags: str, names: set[str]) -> str:
    """flags less every flag called one of names, the rest of the string as written."""
    for name in names:
        flags = re.sub(rf"(?:^|\s)--?{name}(?:=\S*)?(?=\s|$)", "", flags)
    return flags.strip()


def merged(ours: str, user: str) -> str:
    """ours, less any flag user sets, then user's string unchanged: a user's choice wins."""
    return " ".join(filter(None, [without(ours, flag_names(user)), user.strip()]))


def cpu_flags(model: str, user: str = "") -> str:
    """XLA_FLAGS for model on XLA:CPU (its MODEL_FUSIONS set), user's flags winning."""
    return merged(FUSIONS[MODEL_FUSIONS.get(model, "ynn-default")], user)
