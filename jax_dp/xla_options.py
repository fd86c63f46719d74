"""XLA:CPU options for each model, chosen by measurement (README, "Speed")."""

from __future__ import annotations

YNN_FUSION = "--xla_cpu_experimental_ynn_fusion_type"
# The YNNPACK fusion sets tried: XLA's default, matrix products only, the default less convolutions.
FUSIONS = {"ynn-default": "", "ynn-dots": f"{YNN_FUSION}=individual_dot",
           "ynn-noconv": f"{YNN_FUSION}=-individual_convolution"}
# model -> (its conv option on CPU, fusion set): the fastest pair in experiments.benchmark.
CHOSEN = {"lenet": ("xla", "ynn-dots"), "resnet18": (None, "ynn-noconv")}


def cpu_conv(model: str) -> str | None:
    """The convolution formulation model runs fastest with on XLA:CPU (None: it has one)."""
    return CHOSEN[model][0]


def cpu_flags(model: str, user: str = "") -> str:
    """XLA_FLAGS for training model on CPU: the measured choice, then user's own flags, leaving
    out any chosen flag that user sets, so a user's choice wins."""
    ours = FUSIONS[CHOSEN[model][1]].split()
    given = {flag.split("=")[0] for flag in user.split()}
    return " ".join([f for f in ours if f.split("=")[0] not in given] + user.split())
