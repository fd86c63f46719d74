"""The step profile: it finds every convolution of the compiled step, of the right kind and shape."""

import json
import os
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dp import assembly, models
from jax_dp.xla_cpu import passes as passes_lib
from jax_dp.xla_cpu.conv import convolution
from experiments.measure import timing, op_times


def compiled_step_hlo(model, batch_size):
    return timing.single_step(model, batch_size)[0].as_text()


def test_lenets_five_convolutions_are_found_with_their_kinds_and_shapes():
    """Catches a convolution missed or mislabelled: LeNet has two forward convolutions, the
    second one's dX (the first's input needs none) and both dWs (with XLA's convolution for
    every pass: no table)."""
    lenet = models.get_model("lenet", conv="xla", convolution=convolution("canonical", "cpu", {}))
    convs = op_times.convolutions(compiled_step_hlo(lenet, 6))
    found = sorted((c["kind"], c["lhs"], c["rhs"], c["out"]) for c in convs)
    assert found == sorted([
        ("conv forward", (6, 28, 28, 1), (3, 3, 1, 20), (6, 26, 26, 20)),
        ("conv forward", (6, 13, 13, 20), (5, 5, 20, 50), (6, 9, 9, 50)),
        ("conv dX", (6, 9, 9, 50), (5, 5, 50, 20), (6, 13, 13, 20)),
        ("conv dW", (1, 28, 28, 6), (26, 26, 6, 20), (1, 3, 3, 20)),
        ("conv dW", (20, 13, 13, 6), (9, 9, 6, 50), (20, 5, 5, 50))])


def test_resnets_strided_convolutions_are_rebuilt_with_their_windows():
    """The narrow ResNet (ResNet-18's code, two one-block stages): 6 convolutions (stem, 4 in
    blocks, 1 shortcut), 5 dX (not the stem's), 9 dW (the 3x3 stride-2 one takes one per phase
    of the stride, 4); each rebuilt alone from its parsed window gives the step's output shape."""
    convs = op_times.convolutions(compiled_step_hlo(assembly.make_model("tests.tiny_resnet"), 2))
    assert Counter(c["kind"] for c in convs) == {"conv forward": 6, "conv dX": 5, "conv dW": 9}
    assert {c["strides"] for c in convs if c["kind"] == "conv forward"} == {(1, 1), (2, 2)}
    for conv in convs:
        rebuilt = jax.eval_shape(lambda a, b: jax.lax.conv_general_dilated(
            a, b, conv["strides"], conv["padding"], conv["lhs_dilation"], conv["rhs_dilation"],
            dimension_numbers=("NHWC", "HWIO", "NHWC")),
            jax.ShapeDtypeStruct(conv["lhs"], jnp.float32), jax.ShapeDtypeStruct(conv["rhs"], jnp.float32))
        assert rebuilt.shape == conv["out"], conv


def test_the_profile_cli_groups_both_steps_the_same_way(tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, "-m", "experiments.profile", "--batch-size", "8",
                           "--repeats", "1", "--peer", "torch", "--pairs", "3", "--json", str(out)],
                          capture_output=True, text=True, env={**os.environ, "JAX_DP_NO_TCMALLOC": "1"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    ours, theirs = result["jax"], result["torch"]
    # The model as trained: LeNet's convolution on CPU is the chosen one (im2col has none), and
    # each pass of each layer is a convolution unless the table gives it another formulation
    # (conv1's dX is never computed: the images need no gradient).
    no_pads = ((0, 0), (0, 0))
    layers = [((8, 28, 28, 1), (3, 3, 1, 20), ("forward", "dw")),
              ((8, 13, 13, 20), (5, 5, 20, 50), ("forward", "dx", "dw"))]
    kind = {"forward": "conv forward", "dx": "conv dX", "dw": "conv dW"}
    table, key = passes_lib.table(), lambda x, w: passes_lib.layer_key(x, w, (1, 1), no_pads)
    passes = [kind[name] for x_shape, w_shape, names in layers for name in names
              if passes_lib.formulation(table, "cpu", name, key(x_shape, w_shape)) == "conv"]
    kinds, n_convs = set(passes), len(passes)
    assert len(ours["convs"]) == n_convs
    for kind in kinds:
        assert ours["by_kind"][kind] == pytest.approx(
            sum(c["ms"] for c in ours["convs"] if c["kind"] == kind)) and ours["by_kind"][kind] > 0
    assert theirs["by_kind"]["conv forward"] > 0 and theirs["by_kind"]["conv backward"] > 0
    assert {r["kind"] for r in theirs["ops"] if r["op"] == "aten::convolution_backward"} == {
        "conv backward"}
    assert f"| conv dW | {ours['by_kind']['conv dW']:.1f} |" in proc.stdout
    # Inside the step: the other ops by kind, then what they leave to the convolutions.
    assert not {c["op"] for c in ours["convs"]} & set(ours["in_step"])
    assert sum(ours["in_step"].values()) == pytest.approx(ours["traced_ms"])
    assert f"Inside the step ({ours['traced_ms']:.1f} ms under" in proc.stdout
    if ours["convs"]:  # The activations each dW transposes.
        assert ours["in_step"]["transpose_copy_fusion"] > 0
    # The two steps in turns: three pairs, their ratios' median reported and printed.
    turns = result["alternated"]
    assert len(turns["jax_s"]) == len(turns["torch_s"]) == 3 and min(turns["torch_s"]) > 0
    assert turns["ratio_median"] == pytest.approx(np.median(np.divide(turns["jax_s"], turns["torch_s"])))
    assert f"ratio {turns['ratio_median']:.2f}x" in proc.stdout


def test_the_profile_cli_refuses_a_batch_of_zero():
    proc = subprocess.run([sys.executable, "-m", "experiments.profile", "--batch-size", "0"],
                          capture_output=True, text=True, env={**os.environ, "JAX_DP_NO_TCMALLOC": "1"})
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "python -m experiments.profile: error: argument --batch-size: must be an integer of at "
        "least 1, got '0' (see --help)"]


@pytest.mark.parametrize("flags,error", [
    (["--pairs", "2"], "--pairs alternates jax_dp's step with PyTorch's: add --peer torch"),
    (["--pairs", "-1", "--peer", "torch"],
     "argument --pairs: must be an integer of at least 0, got '-1' (see --help)")])
def test_the_profile_cli_refuses_pairs_it_cannot_time(flags, error):
    proc = subprocess.run([sys.executable, "-m", "experiments.profile", *flags],
                          capture_output=True, text=True, env={**os.environ, "JAX_DP_NO_TCMALLOC": "1"})
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"python -m experiments.profile: error: {error}"]


def test_alternate_takes_the_two_in_turns_after_a_warm_up_of_each():
    calls = []
    first, second = op_times.alternate(lambda: calls.append("a"), lambda: calls.append("b"), 3)
    assert calls == ["a", "b"] * 4 and len(first) == len(second) == 3
    assert all(t >= 0 for t in first + second)


def test_overlapping_events_are_counted_once():
    """An op's parallel pieces on two threads overlap: [0, 10) and [5, 12) cover 12 ns, not 17;
    a later piece [20, 25) adds 5."""
    assert op_times._covered_ns([(5, 12), (0, 10), (20, 25), (21, 22)]) == 17
    assert op_times._covered_ns([]) == 0


def test_in_step_finds_the_ops_of_the_compiled_step_by_their_hlo_names():
    """A matrix product and an elementwise op, found in the trace by their HLO names (whatever
    fusion XLA puts them in), each with a time; how long each takes is not checked."""
    x = jnp.ones((1024, 1024))
    compiled = jax.jit(lambda a: jnp.tanh(a @ a) + 1).lower(x).compile()
    ops, step_ms = op_times.in_step(compiled, (x,), repeats=3)
    assert len(ops) >= 2 and set(ops) <= set(op_times._NAME.findall(compiled.as_text()))
    assert all(np.isfinite(ms) and ms >= 0 for ms in ops.values())
    assert np.isfinite(step_ms) and step_ms > 0


def test_each_ops_events_count_once_per_step():
    """Catches an op's events counted twice or per run, not per step: "fusion.1" runs on two
    threads over [0, 10) and [5, 12) ns, then [20, 25) (17 ns); "dot.2" [100, 400) on one (300
    ns); events of no op of the step (the runtime's own) are left out. Over 2 steps: per step,
    8.5 and 150 ns."""
    def line(*events):
        return SimpleNamespace(events=[SimpleNamespace(name=n, start_ns=s, duration_ns=d)
                                       for n, s, d in events])
    planes = [SimpleNamespace(lines=[line(("fusion.1", 0, 10), ("ThunkExecutor", 0, 500)),
                                     line(("fusion.1", 5, 7), ("dot.2", 100, 300))]),
              SimpleNamespace(lines=[line(("fusion.1", 20, 5))])]
    assert op_times.op_ms(planes, {"fusion.1", "dot.2", "tanh.3"}, steps=2) == pytest.approx(
        {"fusion.1": 8.5e-6, "dot.2": 150e-6})


def test_ops_are_grouped_by_kind():
    assert op_times.group("transpose_copy_fusion.12") == "transpose_copy_fusion"
    assert op_times.group("dot") == "dot"
