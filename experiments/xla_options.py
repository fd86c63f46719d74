"""The XLA options an experiment sets before JAX's backend starts (jax_dp.xla_cpu.flags)."""

from __future__ import annotations

import os


def use(model: str, show: bool = True) -> None:
    """Set the XLA_FLAGS measured fastest for model (docs/speed.md), the user's own winning.

    XLA reads them once, when its backend starts: call this after importing JAX if need be,
    but before the first JAX operation (every experiment calls it before it sets up devices).
    """
    from jax_dp.xla_cpu.flags import accelerator_expected

    accelerator = accelerator_expected()
    flags = flags_for(model, os.environ.get("XLA_FLAGS", ""), accelerator)
    os.environ["XLA_FLAGS"] = flags
    if show:
        print(f"XLA_FLAGS: {flags or '(none)'}"
              + (" (on an accelerator: no XLA:CPU option is set)" if accelerator else ""),
              flush=True)


def flags_for(model: str, user: str, accelerator: bool = False) -> str:
    """XLA_FLAGS for model: its YNNPACK fusion set (jax_dp.xla_cpu.flags.MODEL_FUSIONS), user's
    flags winning; on an accelerator, the user's alone (the sets were measured on XLA:CPU)."""
    from jax_dp.xla_cpu import flags

    return user.strip() if accelerator else flags.cpu_flags(model, user)
