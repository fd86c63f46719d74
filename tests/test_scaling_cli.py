"""experiments.scaling: the cost model wired to fixed measurements, a quick run's measuring and
outputs (what it times, not how fast), and its one-line errors."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import forked_commands

from experiments.measure import hardware, cost_model, cost_report, step_costs
from experiments.measure.cost_model import Link
from jax_dp import assembly, models
from jax_dp.devices import get_devices

QUICK = ["--model", "lenet", "--devices", "2", "--processes", "2", "--batch-size", "64",
         "--steps", "2", "--repeats", "1", "--sizes", "2"]
HARDWARE = Path(__file__).parents[1] / "experiments" / "measure" / "hardware.json"


def scaling_cli(*flags):
    return subprocess.run([sys.executable, "-m", "experiments.scaling", *flags],
                          capture_output=True, text=True, timeout=600)


# Measured parts written by hand. Compute: 2 ms + 0.1 ms per image on 1 core, 1 ms + 0.05 ms on
# 2. All-reduces of 4096 and 40,000 bytes over 2 devices (2 messages, all the bytes on the
# busiest link): psum 10 us per message and 1 GB/s in one process, 100 us and 100 MB/s between
# 2 processes (gloo); the ring in one process 20 us and 0.5 GB/s, for no prediction to use.
MEASURED = {
    "compute": {1: {"16": 3.6e-3, "32": 5.2e-3, "64": 8.4e-3},
                2: {"16": 1.8e-3, "32": 2.6e-3, "64": 4.2e-3}},
    "configs": {
        "1x1": {"allreduce": [], "fixed_s": 0.5e-3, "step_s": 5e-3, "arrays": 0},
        "1x2": {"allreduce": [{"scheme": "psum", "bytes": 4096, "seconds": 24.096e-6},
                              {"scheme": "psum", "bytes": 40_000, "seconds": 60e-6},
                              {"scheme": "ring", "bytes": 4096, "seconds": 48.192e-6},
                              {"scheme": "ring", "bytes": 40_000, "seconds": 120e-6}],
                "fixed_s": 0.6e-3, "step_s": 6e-3, "arrays": 3},
        "2x1": {"allreduce": [{"scheme": "psum", "bytes": 4096, "seconds": 240.96e-6},
                              {"scheme": "psum", "bytes": 40_000, "seconds": 600e-6}],
                "fixed_s": 0.8e-3, "step_s": 5.5e-3, "arrays": 1},
        "2x2": {"allreduce": [], "fixed_s": 0.9e-3, "step_s": 10e-3, "arrays": 1}}}
# 0.5 TFLOP/s reached, 0.1 ms per step; 2 devices a node: 10 us and 1 GB/s within, 100 us and
# 100 MB/s between. LeNet 2 ms per image on it, ResNet-18 20 ms; both 1 MB of gradients.
TOY = hardware.Hardware("toy", 5e11, 1e-4, 2, Link(1e-5, 1e-9), Link(1e-4, 1e-8))
SHAPES = {"lenet": {"flops_per_image": 1e9, "grad_bytes": 1_000_000},
          "resnet18": {"flops_per_image": 1e10, "grad_bytes": 1_000_000}}


def analysed():
    """The model over the parts above: LeNet, global batch 64, 40 kB of gradients, 2 cores."""
    return cost_model.analyse("lenet", 64, 40_000, MEASURED, 2, {"toy": TOY}, SHAPES)


def test_each_config_is_predicted_from_its_measured_parts():
    """Catches a part charged twice or to the wrong config: by hand, 1 device gets both cores'
    line at 64 images; 1 process's 2 devices a core each at 32; 2 processes a core each, on
    which their own 2 devices take turns at 16. The all-reduce is psum's: in one process 3
    arrays x 2 messages x 10 us + 40 kB at 1 GB/s; between 2 processes (whatever their devices)
    2 x 100 us + 40 kB at 100 MB/s. Overlapped, it hides behind 2/3 of the compute."""
    checks = {c["config"]: c for c in analysed()["checks"]}
    # Devices, processes; compute, all-reduce, predicted, overlapped, measured (ms); error.
    want = {"1x1": (1, 1, [4.2, 0.0, 4.7, 4.7, 5.0], -0.06),
            "1x2": (2, 1, [5.2, 0.1, 5.9, 5.8, 6.0], 5.9 / 6 - 1),
            "2x1": (2, 2, [5.2, 0.6, 6.6, 6.0, 5.5], 0.2),
            "2x2": (4, 2, [7.2, 0.6, 8.7, 8.1, 10.0], -0.13)}
    assert list(checks) == list(want)
    for name, (devices, processes, ms, error) in want.items():
        c, m = checks[name], MEASURED["configs"][name]
        assert (c["devices"], c["processes"], c["arrays"], c["fixed_s"]) == \
            (devices, processes, m["arrays"], m["fixed_s"])
        assert [1e3 * c[k] for k in ("compute_s", "allreduce_s", "predicted_s",
                                     "predicted_overlap_s", "measured_s")] == pytest.approx(ms)
        assert c["error"] == pytest.approx(error), name


def test_the_fitted_parts_are_the_hand_written_ones():
    r = analysed()
    assert {c: cost_model.Line(**line) for c, line in r["lines"].items()} == {
        "1": pytest.approx(cost_model.Line(2e-3, 1e-4)),
        "2": pytest.approx(cost_model.Line(1e-3, 5e-5))}
    links = {(t, s): Link(**link) for t, by in r["links"].items() for s, link in by.items()}
    assert links == {("in-process", "psum"): pytest.approx(Link(10e-6, 1e-9)),
                     ("in-process", "ring"): pytest.approx(Link(20e-6, 2e-9)),
                     ("gloo", "psum"): pytest.approx(Link(100e-6, 1e-8))}


def test_a_profiles_curves_and_crossovers_by_hand():
    """LeNet on the toy at the book's 256 images: 512 ms of compute, 0.1 ms fixed; a ring of 2
    in one node sends the whole 1 MB in 2 messages (1.02 ms), which overlap hides behind the
    backward pass. Half of ideal weak scaling needs (1.02 - 0.1) / 2 = 0.46 images a device on
    2; 8 and 64 devices cross nodes: 14 messages of 1/8 MB (18.9 ms), 9.4 images; 126 of 3907
    floats (32.29 ms), 16.1 images."""
    r = analysed()
    lenet = r["profiles"]["toy"]["lenet"]
    assert r["profiles"]["toy"]["name"] == "toy" and r["book"] is None
    assert set(lenet) == {"weak", "strong", "weak_overlap", "strong_overlap", "min_batch"}
    assert all(len(lenet[kind]) == 7 and lenet[kind][0] == pytest.approx(1.0)
               for kind in ("weak", "strong", "weak_overlap", "strong_overlap"))
    assert lenet["weak"][1] == pytest.approx(2 * 0.5121 / 0.51312)
    assert lenet["strong"][1] == pytest.approx(0.5121 / 0.25712)
    assert lenet["weak_overlap"][1] == pytest.approx(2.0)
    assert lenet["strong_overlap"][1] == pytest.approx(0.5121 / 0.2561)
    assert lenet["min_batch"] == pytest.approx(
        {2: 0.46, 8: 9.4, 64: (126e-4 + 126 * 3907 * 4 * 1e-8 - 1e-4) / 2e-3})


def test_the_report_shows_the_checks_fits_and_crossovers():
    text = cost_report.markdown({**analysed(), "cores": 2, "cpu": "a test CPU"})
    for row in ["lenet, global batch 64, gradients 0.04 MB, 2 cores (a test CPU)",
                "| 1 process(es) x 1 device(s) | 0.0042 | 0.0000 | 0.0005 | 0.0047 | 0.0047 "
                "| 0.0050 | -6% |",
                "| 1 process(es) x 2 device(s) | 0.0052 | 0.0001 | 0.0006 | 0.0059 | 0.0058 "
                "| 0.0060 | -2% |",
                "| 2 process(es) x 1 device(s) | 0.0052 | 0.0006 | 0.0008 | 0.0066 | 0.0060 "
                "| 0.0055 | +20% |",
                "| 2 process(es) x 2 device(s) | 0.0072 | 0.0006 | 0.0009 | 0.0087 | 0.0081 "
                "| 0.0100 | -13% |",
                "| in-process | psum | 10.0 | 1.00 |", "| in-process | ring | 20.0 | 0.50 |",
                "| gloo | psum | 100.0 | 0.10 |",
                "| 1 | fitted | 2.00 | 0.100 |", "| 2 | fitted | 1.00 | 0.050 |",
                "| toy | lenet | 1 | 10 | 17 |", "| toy | resnet18 | 1 | 1 | 2 |"]:
        assert f"\n{row}\n" in f"\n{text}\n", row
    assert "book (V100 PCIe)" not in text  # No V100 PCIe profile to compare the book with.


def test_a_quick_run_measures_every_part_and_reports_the_model_over_them(tmp_path):
    """What the run times and writes, not how fast: every part measured (and positive), the
    right arrays and schemes, and the model, tables and figure made from those measurements."""
    proc = scaling_cli(*QUICK, "--json", str(tmp_path / "s.json"),
                       "--plot", str(tmp_path / "s.png"))
    assert proc.returncode == 0, proc.stderr
    r = json.loads((tmp_path / "s.json").read_text())
    assert (tmp_path / "s.png").stat().st_size > 0
    measured = r["measured"]
    assert set(measured["compute"]) == {"1", str(r["cores"])}
    assert all(set(times) == {"32", "64"} for times in measured["compute"].values())
    configs = measured["configs"]
    assert list(configs) == ["1x2", "2x1", "2x2"]  # 1 device alone: the test below.
    # The step all-reduces LeNet's 8 gradients and 3 metric sums as one buffer: one collective.
    assert [configs[c]["arrays"] for c in configs] == [1, 1, 1]
    schemes = {c: sorted({(a["scheme"], a["bytes"]) for a in m["allreduce"]})
               for c, m in configs.items()}
    sizes = [4096, 4 * round(models.param_bytes("lenet") / 4)]
    assert schemes["1x2"] == schemes["2x1"] == sorted((s, n) for s in ("psum", "ring", "star")
                                                      for n in sizes)
    assert schemes["2x2"] == []  # 2x2 times its step alone.
    seconds = [t for times in measured["compute"].values() for t in times.values()] + \
        [m[k] for m in configs.values() for k in ("fixed_s", "step_s")] + \
        [a["seconds"] for m in configs.values() for a in m["allreduce"]]
    assert all(math.isfinite(t) and t > 0 for t in seconds)
    assert r["shapes"]["lenet"]["grad_bytes"] == r["grad_bytes"] == models.param_bytes("lenet")
    assert all(s["flops_per_image"] > 0 for s in r["shapes"].values())
    # The model, tables and figure are those of exactly these measurements.
    profiles = hardware.load_profiles(HARDWARE)
    again = cost_model.analyse("lenet", 64, r["grad_bytes"], measured, r["cores"], profiles,
                                  r["shapes"])
    assert json.loads(json.dumps(again)) == {k: r[k] for k in again}
    assert cost_report.markdown({**again, "cores": r["cores"], "cpu": r["cpu"]}) in proc.stdout


def test_one_device_is_measured_with_no_all_reduce():
    """What a 1x1 worker measures, in this process: its fixed cost and step, no all-reduce and
    no all-reduced array (the quick run measures 2 devices)."""
    spec = {"steps": 2, "batch_size": 64, "repeats": 1, "sizes": [4096]}
    m = step_costs.measure_devices(spec, assembly.make_model("lenet"), get_devices(1))
    assert m["allreduce"] == [] and m["arrays"] == 0
    assert all(math.isfinite(m[k]) and m[k] > 0 for k in ("fixed_s", "step_s"))


BAD_INPUT = [
    (["--profiles", "/nonexistent/hw.json"],
     "--profiles file '/nonexistent/hw.json' does not exist"),
    (["--devices", "0"], "--devices must be at least 1, got 0"),
    (["--devices", "2,-1"], "--devices must be at least 1, got -1"),
    (["--processes", "1"], "--processes must be 0 (skip) or at least 2, got 1"),
    (["--batch-size", "63", "--devices", "2"], "--batch-size 63 must split evenly"),
    (["--batch-size", "1", "--devices", "1"],
     "--batch-size: must be an integer of at least 2, got '1'"),
    (["--sizes", "1"], "--sizes: must be an integer of at least 2, got '1'"),
    (["--steps", "0"], "--steps: must be an integer of at least 1, got '0'"),
]


@pytest.fixture(scope="module")
def bad_input_runs():
    """Every BAD_INPUT case, by its flags, run once in this process (tests/forked.py)."""
    cases = [tuple(flags) for flags, _ in BAD_INPUT]
    return dict(zip(cases, forked_commands(tuple(("experiments.scaling", *c) for c in cases),
                                           dict(os.environ))))


@pytest.mark.parametrize("flags, message", BAD_INPUT)
def test_bad_input_is_one_line(flags, message, bad_input_runs):
    proc = bad_input_runs[tuple(flags)]
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr


def test_a_malformed_profile_file_is_one_line(tmp_path):
    (tmp_path / "hw.json").write_text("{not json")
    proc = scaling_cli("--profiles", str(tmp_path / "hw.json"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "is not valid JSON" in proc.stderr
