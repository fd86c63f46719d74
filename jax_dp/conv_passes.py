"""Which formulation each pass of a convolution takes, by platform and layer shape.

Written by `python -m experiments.conv_passes --model M`, which times every formulation of
every pass of M's convolutions on this machine and rewrites TABLE (docs/speed.md). A shape or
platform that is not in it takes XLA's convolution. Nothing is timed when a run starts: a run
with the same config computes the same bits on any machine with the same table.
"""

from __future__ import annotations

# The formulations of each pass (jax_dp.conv): XLA's convolution ("conv"), or
#   forward: "taps", one matrix product of the input's windows (its shifted slices side by
#     side) against the kernel;
#   dx: "taps", one matrix product of the cotangent against the kernel, each tap's share then
#     shifted into place;
#   dw: "taps", one matrix product of the input's windows against the cotangent.
FORMULATIONS = {"forward": ("conv", "taps"), "dx": ("conv", "taps"), "dw": ("conv", "taps")}

# platform -> layer key (conv.layer_key) -> pass -> formulation; experiments.conv_passes
# rewrites the lines from here to the end of the file.
TABLE: dict[str, dict[str, dict[str, str]]] = {
    "cpu": {
        "13x13x20 5x5x20x50 s1x1 p0,0x0,0": {
            "dx": "taps"
        },
        "28x28x1 3x3x1x20 s1x1 p0,0x0,0": {
            "dw": "taps",
            "dx": "taps",
            "forward": "taps"
        }
    }
}
