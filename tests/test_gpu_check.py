"""The prepared accelerator check runs end to end (tiny sizes, on CPU), so it cannot rot."""

import json
import os
import subprocess
import sys

import pytest


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
    assert 0 < r["exact"]["ratio"] < 10
    assert "fastest LeNet: " in proc.stdout and "| jit | 2 | " in proc.stdout
