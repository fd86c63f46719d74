"""The prepared accelerator check runs end to end (tiny sizes, on CPU), so it cannot rot."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import gpu_check
from experiments.measure import timing
from jax_dp import data
from jax_dp.devices import get_devices


def test_the_quick_check_measures_every_part_and_agrees(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "-m", "experiments.gpu_check", "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_DP_NO_TCMALLOC": "1"})
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["platform"] == "cpu" and r["devices"] == 2 and r["versions"]["jax"]
    calls = r["lenet_steps_per_call"]
    assert [c["steps_per_call"] for c in calls] == [1, 4]
    # The same run at any steps per call: the same test accuracy (bit-exact params, test_loop).
    assert len({c["test_acc"] for c in calls}) == 1
    assert all(c["epoch_s"] > 0 and c["images_per_s"] == pytest.approx(512 / c["epoch_s"]) for c in calls)
    assert [row["conv_grads"] for row in r["resnet18_book"]] == ["canonical", "xla"]
    assert all(row["images_per_s"] == pytest.approx(8 / row["step_s"]) for row in r["resnet18_book"])
    assert "| canonical | 8 | " in proc.stdout and "| xla | 8 | " in proc.stdout
    assert {(a["backend"], a["devices"]) for a in r["agreement"]} == {
        (b, k) for b in ("pmap", "shard_map", "jit") for k in (1, 2)}
    assert all(a["max_rel_diff"] <= 1e-6 for a in r["agreement"])
    e = r["exact"]
    assert all(math.isfinite(e[k]) and e[k] > 0 for k in ("normal_step_s", "exact_step_s", "ratio"))
    assert f"({e['ratio']:.2f}x)" in proc.stdout
    assert "fastest LeNet: " in proc.stdout and "| jit | 2 | " in proc.stdout


def test_the_exact_modes_cost_is_the_median_of_each_pairs_ratio(monkeypatch):
    """Catches a ratio upside down or of the medians: each pair times the normal step, then the
    exact one; fake timings of 1, 2, 4 s against 3, 2, 8 s have medians 2 and 3 s, and ratios
    3, 1, 2 whose median is 2 (that of the medians would be 1.5)."""
    times, modes = iter([1.0, 3.0, 2.0, 2.0, 4.0, 8.0]), []

    def time_steps(model, backend, devices, batches, repeats, exact):
        modes.append(exact)
        return {"step_s": [next(times)]}
    monkeypatch.setattr(timing, "time_steps", time_steps)
    split = data.Split(np.zeros((16, 28, 28, 1), np.float32), np.zeros(16, np.int32))
    cost = gpu_check.exact_cost({"lenet_batch": 8, "exact_steps": 2, "exact_pairs": 3}, split,
                                get_devices(1)[0])
    assert modes == [False, True] * 3
    assert cost == {"normal_step_s": 2.0, "exact_step_s": 3.0, "ratio": 2.0}
