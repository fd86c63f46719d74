"""Hardware profiles as data (experiments/measure/hardware.json): what the cost model needs of a machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, NamedTuple

from experiments.measure import cost_model
from experiments.measure.cost_model import Link
from jax_dp.errors import ParamError

FIELDS = ("name", "tflops", "efficiency", "fixed_s", "devices_per_node", "intra", "inter")


class Hardware(NamedTuple):
    """A machine: reached float32 FLOP/s, a fixed cost per step, and the links within and
    between nodes of devices_per_node devices."""
    name: str
    flops: float
    fixed_s: float
    devices_per_node: int
    intra: Link
    inter: Link

    def link(self, k: int) -> Link:
        """The slowest link a ring over k devices crosses."""
        return self.intra if k <= self.devices_per_node else self.inter

    def step(self, flops_per_image: float, grad_bytes: int, scheme: str = "ring",
             overlap: bool = False) -> Callable[[float, int], float]:
        """step(per-device batch, k): predicted seconds of one data-parallel step."""
        def seconds(b: float, k: int) -> float:
            comm = cost_model.allreduce_s(self.link(k), scheme, grad_bytes, k)
            compute = flops_per_image * b / self.flops
            return cost_model.step_s(compute, comm, self.fixed_s, overlap)
        return seconds


def load_profiles(path: str | Path) -> dict[str, Hardware]:
    """The profiles in a JSON file ({"profiles": {key: {...}}}), checked field by field."""
    try:
        profiles = json.loads(Path(path).read_text())["profiles"]
    except FileNotFoundError:
        raise ParamError("profiles", f"{{}} file {str(path)!r} does not exist: pass a hardware "
                         "JSON such as experiments/measure/hardware.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ParamError("profiles", f"{{}} file {str(path)!r} is not valid JSON ({e})") from None
    except (KeyError, TypeError):
        raise ParamError("profiles", f"{{}} file {str(path)!r} has no \"profiles\" object") from None
    return {key: _profile(path, key, p) for key, p in profiles.items()}


def _profile(path, key: str, p: dict) -> Hardware:
    missing = [f for f in FIELDS if not isinstance(p, dict) or f not in p]
    if missing:
        raise ParamError("profiles", f"{{}} file {str(path)!r}: profile {key!r} lacks {', '.join(missing)}")
    try:
        links = [Link(float(p[side]["alpha"]), 1 / float(p[side]["bandwidth"])) for side in ("intra", "inter")]
        hw = Hardware(str(p["name"]), float(p["tflops"]) * 1e12 * float(p["efficiency"]),
                      float(p["fixed_s"]), int(p["devices_per_node"]), *links)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ParamError("profiles", f"{{}} file {str(path)!r}: profile {key!r} has a bad value ({e!r})") from None
    if hw.flops <= 0 or hw.devices_per_node < 1 or min(*hw.intra, *hw.inter, hw.fixed_s) < 0:
        raise ParamError("profiles", f"{{}} file {str(path)!r}: profile {key!r} needs positive "
                         "tflops, efficiency, bandwidths and devices_per_node")
    return hw
