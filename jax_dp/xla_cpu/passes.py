"""Which formulation each pass of a convolution takes, by platform and layer: a measured table.

The table is data, passes.json beside this file, written by
`python -m experiments.conv_passes --model M --write`, which times every formulation of every
pass of M's convolutions on this machine (docs/speed.md). A layer or platform that is not in it
takes XLA's convolution. Nothing is timed when a run starts: a run with the same config computes
the same bits on any machine with the same table.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from jax_dp import files

# The formulations of each pass (jax_dp.xla_cpu.conv): XLA's convolution ("conv"), or
#   forward: "taps", one matrix product of the input's windows (its shifted slices side by
#     side) against the kernel;
#   dx: "taps", one matrix product of the cotangent against the kernel, each tap's share then
#     shifted into place;
#   dw: "taps", one matrix product of the input's windows against the cotangent.
FORMULATIONS = {"forward": ("conv", "taps"), "dx": ("conv", "taps"), "dw": ("conv", "taps")}
PATH = Path(__file__).with_name("passes.json")

Table = dict[str, dict[str, dict[str, str]]]  # platform -> layer key -> pass -> formulation


@functools.lru_cache(maxsize=None)
def table(path: Path = PATH) -> Table:
    """The table in path (passes.json by default)."""
    return json.loads(Path(path).read_text())


def layer_key(x_shape, w_shape, strides, pads) -> str:
    """A convolution layer's key in the table: input, kernel, strides and padding, not the
    batch ('13x13x20 5x5x20x50 s1x1 p0,0x0,0')."""
    return (f"{'x'.join(map(str, x_shape[1:]))} {'x'.join(map(str, w_shape))} "
            f"s{'x'.join(map(str, strides))} p{'x'.join(f'{lo},{hi}' for lo, hi in pads)}")


def formulation(passes: Table, platform: str, name: str, key: str) -> str:
    """The formulation passes gives pass name of layer key on platform ('conv' where none)."""
    return passes.get(platform, {}).get(key, {}).get(name, "conv")


def write(passes: Table, path: Path = PATH) -> None:
    """Write passes as the table's JSON, whole (jax_dp.files)."""
    files.write(Path(path), (json.dumps(passes, indent=2, sort_keys=True) + "\n").encode())
    table.cache_clear()
