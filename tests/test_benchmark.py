"""The benchmark experiment: it measures what it says (not how fast: that is not a test)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from experiments.measure import timing
from jax_dp import assembly
from jax_dp.devices import get_devices
from jax_dp.xla_cpu.flags import FUSIONS


def test_step_flops_match_the_models_arithmetic():
    # LeNet forward: conv1 26*26*20*9, conv2 9*9*50*500, fc 800*128 + 128*10 multiply-adds;
    # a training step costs about three forwards.
    forward = 2 * (26 * 26 * 20 * 9 + 9 * 9 * 50 * 500 + 800 * 128 + 128 * 10)
    flops = timing.step_flops(assembly.make_model("lenet"), 4) / 4
    assert 2.8 * forward < flops < 3.2 * forward


class FakeClock:
    """benchmark's time.perf_counter, advancing by `tick` seconds at every reading (the
    clock that JAX and other libraries read is left alone)."""

    def __init__(self, tick):
        self.now, self.tick = 0.0, tick

    def perf_counter(self):
        self.now += self.tick
        return self.now


def test_matmul_ceiling_is_flops_over_the_median_time(monkeypatch):
    """Catches a wrong FLOP count or unit (2 n^3 multiply-adds, GFLOP/s): each product takes
    exactly one tick of a fake clock, so the rate is known."""
    monkeypatch.setattr(timing, "time", FakeClock(0.5))
    assert timing.matmul_ceiling(n=64, repeats=3) == pytest.approx(2 * 64**3 / 0.5 / 1e9)


def test_time_steps_reports_seconds_per_step(monkeypatch):
    """Catches a per-step time off by the number of steps or repeats: with a fake clock
    ticking 1 s per reading, a repeat of 4 steps spans 1 s, so 0.25 s per step."""
    batches = [{"image": np.zeros((4, 28, 28, 1), np.float32), "label": np.zeros(4, np.int32),
                "mask": np.ones(4, np.float32)}] * 4
    monkeypatch.setattr(timing, "time", FakeClock(1.0))
    result = timing.time_steps(assembly.make_model("lenet"), "pmap", get_devices(2), batches,
                                  repeats=3)
    assert result["step_s"] == [0.25] * 3 and result["compile_s"] == 1.0


def test_the_benchmark_times_each_path_and_device_count(tmp_path):
    """Each path is a formulation under a YNNPACK fusion set, timed with that set's flags, on
    each device count in turn (one worker process each: 2 paths x 1 count here)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "experiments.benchmark", "--model", "lenet",
                           "--paths", "readable/ynn-dots,im2col/ynn-default", "--devices", "2",
                           "--steps", "3", "--repeats", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert [(r["path"], r["devices"], r["xla_flags"]) for r in result["runs"]] == [
        ("jax readable/ynn-dots", 2, FUSIONS["ynn-dots"]), ("jax im2col/ynn-default", 2, "")]
    for run in result["runs"]:
        assert len(run["step_s"]) == 2 and run["images_per_s"] > 0 and run["compile_s"] > 0
        # The ceiling is timed apart from the steps, so a slow spell may fall on either: the
        # fraction is checked as its formula, not as a bound.
        assert run["fraction_of_ceiling"] == pytest.approx(
            result["flops_per_step"] / np.median(run["step_s"]) / 1e9 / result["matmul_ceiling_gflops"])
    assert "| jax im2col/ynn-default | 2 |" in proc.stdout


def test_a_path_runs_under_its_own_fusion_set_and_the_users_other_flags(monkeypatch):
    """Catches a path timed under the user's fusion set instead of its own (mislabelled rows)."""
    from experiments.benchmark import flags_for

    monkeypatch.setenv("XLA_FLAGS", f"-{FUSIONS['ynn-dots'][2:]} --xla_cpu_use_onednn=true")
    assert flags_for(FUSIONS["ynn-noconv"]) == f"{FUSIONS['ynn-noconv']} --xla_cpu_use_onednn=true"
    assert flags_for("") == "--xla_cpu_use_onednn=true"


def test_every_formulation_is_timed_under_every_fusion_set():
    from experiments.benchmark import paths

    assert sorted(paths("lenet")) == sorted(f"{form}/{fusion}" for form in ("readable", "im2col")
                                            for fusion in FUSIONS)
    assert paths("lenet")["im2col/ynn-noconv"] == ({"conv": "im2col"}, FUSIONS["ynn-noconv"])


def test_the_torch_peer_trains_the_same_models():
    import torch

    from experiments.measure import torch_peer

    count = lambda net: sum(p.numel() for p in net.parameters())
    assert count(torch_peer.lenet()) == 129_068
    assert count(torch_peer.resnet18()) == 11_171_914  # The same layers as jax_dp.models.resnet.
    assert torch_peer.lenet()(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
