"""experiments.conv_passes: the layers it finds, its table, and the file it writes."""

import importlib.util
import subprocess
import sys

from experiments import conv_passes as command
from jax_dp import conv_passes


def test_it_finds_lenets_two_convolutions():
    found = command.layers("lenet", {"conv": "xla", "activation": "relu", "conv_grads": "auto"}, 8)
    assert [(x[1:], w) for x, w, _, _ in found] == [((28, 28, 1), (3, 3, 1, 20)),
                                                   ((13, 13, 20), (5, 5, 20, 50))]


def test_a_formulation_replaces_xlas_only_when_faster_by_the_margin():
    assert command.choose({"dx": {"conv": 10.0, "taps": 6.0}}, 0.05) == {"dx": "taps"}
    assert command.choose({"dx": {"conv": 10.0, "taps": 9.8}}, 0.05) == {}
    assert command.choose({"dx": {"conv": 5.0, "taps": 6.0}}, 0.05) == {}


def test_the_written_table_is_read_back_and_keeps_other_platforms(tmp_path, monkeypatch):
    copy = tmp_path / "conv_passes.py"
    copy.write_text(command.TABLE_FILE.read_text())
    monkeypatch.setattr(command, "TABLE_FILE", copy)
    monkeypatch.setattr(conv_passes, "TABLE", {"gpu": {"a": {"dx": "taps"}}})
    command.write_table("cpu", {"13x13x20 5x5x20x50 s1x1 p0,0x0,0": {"dx": "taps"}})
    spec = importlib.util.spec_from_file_location("written", copy)
    written = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(written)
    assert written.TABLE == {"cpu": {"13x13x20 5x5x20x50 s1x1 p0,0x0,0": {"dx": "taps"}},
                             "gpu": {"a": {"dx": "taps"}}}
    assert written.FORMULATIONS == conv_passes.FORMULATIONS


def test_the_command_times_every_formulation_of_every_layer():
    proc = subprocess.run([sys.executable, "-m", "experiments.conv_passes", "--model", "lenet",
                           "--batch-size", "4", "--repeats", "1"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 13x13x20") or
            line.startswith("| 28x28x1")]
    assert len(rows) == 2 * 3 * 2  # 2 layers x 3 passes (forward, dX, dW) x 2 formulations.
    assert sum(row.endswith("| yes |") for row in rows) == 2 * 3  # One chosen per layer and pass.
