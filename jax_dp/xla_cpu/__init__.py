"""XLA:CPU's speed work, one layer beside the book's path: the convolution a model is built with
on each platform (conv.py; each pass's formulation from a measured table, passes.py and
passes.json) and the YNNPACK fusion flags each model trains with (flags.py); docs/speed.md.
Nothing here imports JAX: a command line reads its choices before JAX starts."""

from jax_dp.models import CONV_GRADS

# How convolution gradients are written: as canonical forward convolutions (conv.py), or XLA's.
GRADS = CONV_GRADS.choices
# Where canonical gradients were measured faster: XLA:CPU only (docs/speed.md). Elsewhere
# 'auto' keeps XLA's own until a measurement there says otherwise (experiments.gpu_check).
CANONICAL_ON = ("cpu",)


def resolve_grads(grads: str, platform: str) -> str:
    """'canonical' or 'xla': grads itself, or for 'auto' the choice made for platform."""
    return grads if grads != "auto" else "canonical" if platform in CANONICAL_ON else "xla"


def auto_choices(options: dict, platform: str) -> dict:
    """What the 'auto' in a model's options stands for on platform."""
    if options.get("conv_grads") != "auto":
        return {}
    return {"conv_grads": resolve_grads("auto", platform)}
