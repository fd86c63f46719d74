"""experiments.conv_passes: the layers it finds, its table, and the file it writes."""

import json
import math
import subprocess
import sys

from experiments import conv_passes as command
from jax_dp.xla_cpu import passes


def test_it_finds_lenets_two_convolutions():
    found = command.layers("lenet", {"conv": "xla", "activation": "relu", "conv_grads": "auto"}, 8)
    assert [(x[1:], w) for x, w, _, _ in found] == [((28, 28, 1), (3, 3, 1, 20)),
                                                   ((13, 13, 20), (5, 5, 20, 50))]


def test_a_formulation_replaces_xlas_only_when_faster_by_the_margin():
    assert command.choose({"dx": {"conv": 10.0, "taps": 6.0}}, 0.05) == {"dx": "taps"}
    assert command.choose({"dx": {"conv": 10.0, "taps": 9.8}}, 0.05) == {}
    assert command.choose({"dx": {"conv": 5.0, "taps": 6.0}}, 0.05) == {}


def test_the_written_table_is_read_back_and_keeps_other_platforms(tmp_path):
    path = tmp_path / "passes.json"
    path.write_text(json.dumps({"gpu": {"a": {"dx": "taps"}}, "cpu": {"b": {"dw": "taps"}}}))
    command.write_table(path, "cpu", {"13x13x20 5x5x20x50 s1x1 p0,0x0,0": {"dx": "taps"}})
    assert passes.table(path) == json.loads(path.read_text()) == {
        "cpu": {"13x13x20 5x5x20x50 s1x1 p0,0x0,0": {"dx": "taps"}, "b": {"dw": "taps"}},
        "gpu": {"a": {"dx": "taps"}}}
    assert not list(tmp_path.glob("*.part"))


def test_the_command_times_every_formulation_of_every_layer_and_the_whole_step():
    proc = subprocess.run([sys.executable, "-m", "experiments.conv_passes", "--model", "lenet",
                           "--batch-size", "4", "--repeats", "1", "--step-rounds", "2",
                           "--margin", "0"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 13x13x20") or
            line.startswith("| 28x28x1")]
    assert len(rows) == 2 * 3 * 2  # 2 layers x 3 passes (forward, dX, dW) x 2 formulations.
    assert sum(row.endswith("| yes |") for row in rows) == 2 * 3  # One chosen per layer and pass.
    if any(row.endswith("| taps | yes |") for row in rows):  # Some choice to check in the step.
        line = next(line for line in proc.stdout.splitlines() if line.startswith("the whole step"))
        ratios = [float(r) for r in line.split(": ")[1].split(", ")]
        assert len(ratios) == 2 and all(math.isfinite(r) and r > 0 for r in ratios)
        kept = "these layers keep XLA's convolution" not in proc.stdout
        assert kept == command.step_gains(ratios, 0.0)


def test_the_step_check_keeps_choices_only_when_the_median_round_gains_by_the_margin():
    assert command.step_gains([0.72, 0.75, 0.90], 0.05)
    assert not command.step_gains([0.89, 1.05, 1.02], 0.05)  # One fast round is not enough.
    assert not command.step_gains([0.97, 0.96, 0.98], 0.05)


def test_an_empty_entry_removes_its_layer_and_nothing_else():
    table = {"cpu": {"a": {"dx": "taps"}, "b": {"forward": "taps"}}, "gpu": {"a": {"dx": "taps"}}}
    assert command.with_entries(table, "cpu", {"a": {}, "c": {"dw": "taps"}}) == {
        "cpu": {"b": {"forward": "taps"}, "c": {"dw": "taps"}}, "gpu": {"a": {"dx": "taps"}}}
    assert command.with_entries({"cpu": {"a": {"dx": "taps"}}}, "cpu", {"a": {}}) == {}


def test_step_ratios_time_the_step_with_the_entries_over_without(monkeypatch):
    """The second of each round's pair is timed with the entries in the table, the first
    without them; the table itself is left as it was."""
    from experiments.measure import timing
    from jax_dp.xla_cpu import conv

    seen, built, original = [], [], conv.convolution
    monkeypatch.setattr(conv, "convolution", lambda grads, platform, table: (
        built.append(table.get("cpu", {})), original(grads, platform, table))[1])
    monkeypatch.setattr(timing, "time_steps", lambda *a, **k: (
        seen.append(built[-1]), {"step_s": [2.0 if len(seen) % 2 else 1.0]})[1])
    key = "13x13x20 5x5x20x50 s1x1 p0,0x0,0"
    table = {"cpu": {"other": {"dx": "taps"}}}
    ratios = command.step_ratios("lenet", {"conv": "xla", "activation": "relu",
                                           "conv_grads": "auto"}, 4, "cpu",
                                 {key: {"dw": "taps"}}, rounds=2, table=table, steps=1)
    assert ratios == [0.5, 0.5]
    assert [s.get(key) for s in seen] == [None, {"dw": "taps"}] * 2
    assert all(s["other"] == {"dx": "taps"} for s in seen)
    assert table == {"cpu": {"other": {"dx": "taps"}}}
