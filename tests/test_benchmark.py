"""The benchmark experiment: it measures what it says (not how fast: that is not a test)."""

import json
import subprocess
import sys

import pytest

from jax_dp import benchmark, models


def test_step_flops_match_the_models_arithmetic():
    # LeNet forward: conv1 26*26*20*9, conv2 9*9*50*500, fc 800*128 + 128*10 multiply-adds;
    # a training step costs about three forwards.
    forward = 2 * (26 * 26 * 20 * 9 + 9 * 9 * 50 * 500 + 800 * 128 + 128 * 10)
    flops = benchmark.step_flops(models.get_model("lenet"), 4) / 4
    assert 2.8 * forward < flops < 3.2 * forward


def test_matmul_ceiling_is_a_plausible_rate():
    assert 1 < benchmark.matmul_ceiling(n=256, repeats=3) < 1e5


def test_the_benchmark_times_each_path_and_device_count(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "experiments.benchmark", "--model", "lenet",
                           "--devices", "1,2", "--steps", "3", "--repeats", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert [(r["path"], r["devices"]) for r in result["runs"]] == [
        ("jax readable", 1), ("jax readable", 2), ("jax im2col", 1), ("jax im2col", 2)]
    for run in result["runs"]:
        assert len(run["step_s"]) == 2 and run["images_per_s"] > 0 and run["compile_s"] > 0
        assert 0 < run["fraction_of_ceiling"] < 1
    assert "| jax im2col | 2 |" in proc.stdout


def test_the_torch_peer_trains_the_same_models():
    torch = pytest.importorskip("torch")
    from jax_dp import torch_peer

    count = lambda net: sum(p.numel() for p in net.parameters())
    assert count(torch_peer.lenet()) == 129_068
    assert count(torch_peer.resnet18()) == 11_171_914  # The same layers as jax_dp.models.resnet.
    assert torch_peer.lenet()(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
