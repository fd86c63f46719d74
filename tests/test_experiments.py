"""The experiments as a user runs them: flags, the book's lines, JSON, one-line errors."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import forked_commands
from jax_dp.config import TrainConfig


def run(module, *flags, env=None):
    """Run `python -m module flags` in a fresh process; returns the completed process."""
    return subprocess.run([sys.executable, "-m", module, *flags], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})


def test_lenet_prints_the_books_lines_and_writes_the_json(tmp_path):
    out = tmp_path / "runs.json"
    proc = run("experiments.lenet", "--devices", "1,2", "--epochs", "2", "--train-examples", "600",
               "--test-examples", "300", "--batch-size", "64", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("epoch ") and ", test acc " in line for line in lines) == 4
    assert "sec/epoch on 2 device(s)" in lines[-1]
    assert sum(line.startswith("config: model=lenet conv=auto") for line in lines) == 2
    # --progress is on, but output is a pipe, not a terminal: no bar.
    assert "\r" not in proc.stderr and "batch" not in proc.stderr, proc.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [runs[i]["config"] for i in (0, 1)] == [dataclasses.asdict(TrainConfig(
        options={"conv": "auto", "activation": "relu", "conv_grads": "auto"}, devices=k, batch_size=64, lr=0.2, epochs=2, train_examples=600, test_examples=300))
        for k in (1, 2)]
    assert [e["epoch"] for e in runs[1]["epochs"]] == [1, 2]
    assert set(runs[0]["epochs"][0]) == {"epoch", "time_s", "train_loss", "train_acc", "test_acc"}


def test_resnet18_defaults_to_the_books_pair_and_trains_on_a_slice(tmp_path):
    """The command's runs are the book's pair (read from its flags); the 2-device one, the
    pair's collective half, trains through the command on a slice."""
    from experiments import cli, resnet18
    pair = cli.configs(resnet18.parser().parse_args([]))
    assert [(c.model, c.options["bn"], c.devices, c.batch_size, c.lr, c.epochs) for c in pair] == [
        ("resnet18", "sync", 1, 256, 0.1, 4), ("resnet18", "sync", 2, 512, 0.2, 4)]
    out = tmp_path / "runs.json"
    proc = run("experiments.resnet18", "--epochs", "1", "--train-examples", "16",
               "--test-examples", "8", "--devices", "2", "--batch-size", "16", "--lr", "0.2",
               "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    (config,) = [r["config"] for r in json.loads(out.read_text())["runs"]]
    assert (config["model"], config["options"]["bn"], config["devices"]) == ("resnet18", "sync", 2)


BAD_FLAGS = [
    (["--devices", "0"], "--devices must be at least 1, got 0"),
    (["--devices", "4", "--env", "JAX_NUM_CPU_DEVICES=2"],
     "asked for 4 devices but only 2 exist (cpu:0, cpu:1); pass --devices 2 or fewer"),
    (["--devices", "two"], "argument --devices: expected counts"),
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--lr", "-1"], "--lr must be a positive finite number, got -1.0"),
    (["--lr", "inf"], "--lr must be a positive finite number, got inf"),
    (["--epochs", "0"], "--epochs must be at least 1, got 0"),
    (["--steps-per-call", "0"], "--steps-per-call must be at least 1, got 0"),
    (["--devices", "1,2", "--lr", "0.1,0.2,0.3"], "--lr has 3 values for 2 device counts"),
    (["--json", "/nonexistent/dir/runs.json"], "cannot write /nonexistent/dir/runs.json"),
    (["--data", "debian", "--idx-dir", "/nonexistent", "--tfds-dir", "{tmp}"],
     "is missing from /nonexistent"),
    # Offline, without Debian's files: --data auto names both ways to the data.
    (["--idx-dir", "/nonexistent", "--download-url", "http://127.0.0.1:9/", "--tfds-dir", "{tmp}"],
     "/nonexistent does not hold its four IDX files, and TFDS's download of them "
     "(http://127.0.0.1:9/) is not reachable: install Debian's dataset-fashion-mnist (or pass "
     "--idx-dir DIR holding the files), or connect to the network for --data download"),
    (["--model", "lenet"], "unrecognized arguments: --model lenet"),
    (["--devices", "999"], "--devices 999 is more than the 256 CPU devices XLA can simulate"),
    (["--train-examples", "100000"], "--train-examples 100000 is more than the 60,000 train images"),
    (["--backend", "jit", "--allreduce", "ring"],
     "--allreduce ring is written for the pmap backend; use --backend pmap"),
]


@pytest.fixture(scope="module")
def bad_flag_runs(tmp_path_factory):
    """Every BAD_FLAGS case that needs no environment of its own, by its flags: run once in
    this process, from one interpreter (tests/forked.py: the same commands, forked)."""
    folder = str(tmp_path_factory.mktemp("data"))
    cases = [tuple(flags) for flags, _ in BAD_FLAGS if "--env" not in flags]
    runs = forked_commands(tuple(("experiments.lenet", *(folder if f == "{tmp}" else f
                                                         for f in c)) for c in cases),
                           dict(os.environ))
    return dict(zip(cases, runs))


@pytest.mark.parametrize("flags,message", BAD_FLAGS)
def test_bad_flags_get_one_line_and_exit_code_2(flags, message, bad_flag_runs):
    if "--env" in flags:
        flags = list(flags)
        name, value = flags.pop(flags.index("--env") + 1).split("=")
        flags.remove("--env")
        proc = run("experiments.lenet", *flags, env={"JAX_DP_NO_TCMALLOC": "1", name: value})
    else:
        proc = bad_flag_runs[tuple(flags)]
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert proc.stderr.startswith("python -m experiments.lenet: error: ")


def test_primitives_prints_the_books_demos():
    proc = run("experiments.primitives")
    assert proc.returncode == 0, proc.stderr
    assert ("before allreduce:\n  [[1., 1.]] on cpu:0\n  [[2., 2.]] on cpu:1\n"
            "after allreduce:\n  [[3., 3.]] on cpu:0\n  [[3., 3.]] on cpu:1") in proc.stdout
    assert "[[12, 13, 14, 15],\n [16, 17, 18, 19],\n [20, 21, 22, 23]] on cpu:1" in proc.stdout
    assert "replicas identical: True" in proc.stdout


def test_lr_scaling_and_plot(tmp_path):
    plot, out = tmp_path / "history.png", tmp_path / "runs.json"
    proc = run("experiments.lenet", "--devices", "1,2", "--batch-size", "32,64", "--lr", "0.2",
               "--lr-scaling", "linear", "--base-batch-size", "32", "--warmup-epochs", "0.5",
               "--epochs", "1", "--train-examples", "256", "--test-examples", "64",
               "--plot", str(plot), "--json", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert [r["config"]["lr"] for r in json.loads(out.read_text())["runs"]] == [0.2, 0.4]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_prints_the_table_and_writes_json_and_plot(tmp_path):
    out, plot = tmp_path / "compare.json", tmp_path / "compare.png"
    proc = run("experiments.compare", "--devices", "1,2", "--backends", "pmap,jit", "--steps", "2",
               "--batch-size", "8", "--json", str(out), "--plot", str(plot))
    assert proc.returncode == 0, proc.stderr
    assert "lenet (conv=auto activation=relu conv_grads=auto), global batch 8, lr 0.2, 2 steps, float32" in proc.stdout
    assert "| single | 1 | reference |" in proc.stdout and "| jit | 2 | " in proc.stdout
    result = json.loads(out.read_text())
    assert result["reference"] == "single"
    assert [(r["backend"], r["devices"]) for r in result["runs"]] == [
        ("single", 1), ("pmap", 1), ("pmap", 2), ("jit", 1), ("jit", 2)]
    for r in result["runs"][1:]:
        assert len(r["per_step_max_rel_diff"]) == 2 and r["max_rel_diff"] <= 1e-6
        assert r["images_per_s"] > 0 and r["compile_s"] > 0
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_compare_refuses_what_it_cannot_compare_in_one_line():
    """A batch that does not split, an unknown backend, a model option a backend cannot hold."""
    split, backend, bn = forked_commands((
        ("experiments.compare", "--devices", "1,4", "--batch-size", "6"),
        ("experiments.compare", "--backends", "pmap,xmap"),
        ("experiments.compare", "--model", "tests.tiny_resnet", "--bn", "local", "--backends",
         "pmap,shard_map")), dict(os.environ))
    assert [p.returncode for p in (split, backend, bn)] == [2, 2, 2]
    assert split.stderr == ("python -m experiments.compare: error: --batch-size 6 does not split "
                            "over 4 devices: use a multiple of every device count\n")
    assert backend.stderr == ("python -m experiments.compare: error: unknown --backends 'xmap': "
                              "use one of pmap, shard_map, jit, single\n")
    assert bn.stderr.count("\n") == 1 and "--bn local keeps statistics per device" in bn.stderr


def test_a_resume_with_another_flag_is_refused_naming_the_flag_and_both_values(tmp_path):
    flags = ["--devices", "2", "--epochs", "1", "--train-examples", "64", "--test-examples", "32",
             "--batch-size", "16", "--checkpoint-dir", str(tmp_path), "--conv", "xla"]
    first, proc = forked_commands((("experiments.lenet", *flags),
                                   ("experiments.lenet", *flags[:-1], "im2col", "--epochs", "2",
                                    "--resume")), dict(os.environ))
    assert first.returncode == 0, first.stderr
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert ("was written with --conv 'xla', this run has --conv 'im2col' (only a larger epochs "
            "may change): resume with the same values or use another --checkpoint-dir") in proc.stderr


def test_help_states_each_default_once():
    """Catches argparse's '(default: ...) (default: None)' doubles and defaults never shown."""
    text = " ".join(run("experiments.lenet", "--help").stdout.split())
    for option in re.split(r" (?=--[a-z-]+ )", text.split("options:")[1]):
        assert option.count("(default:") <= 1, option
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "--train-examples TRAIN_EXAMPLES train on the first N training examples (default: 60000)" in text
    assert "--seed SEED seed of params and data order (default: 0)" in text


# A value unlike the default for every TrainConfig field that has a flag of its name (the
# model's options and the per-run devices, batch size and lr have their own checks).
FLAG_VALUES = {"backend": ("shard_map", "shard_map"), "allreduce": ("star", "star"),
               "warmup_epochs": ("0.5", 0.5), "epochs": ("7", 7), "seed": ("3", 3),
               "exact": (None, True), "compute_dtype": ("bfloat16", "bfloat16"),
               "drop_remainder": (None, True), "train_examples": ("1000", 1000),
               "test_examples": ("500", 500)}


@pytest.mark.parametrize("field", sorted(FLAG_VALUES))
def test_each_flag_reaches_the_trainconfig_it_builds(field):
    """Catches a flag parsed but dropped (or renamed) between the command line and the run."""
    from experiments import cli, lenet

    flag, (text, value) = f"--{field.replace('_', '-')}", FLAG_VALUES[field]
    args = lenet.parser().parse_args([flag] if text is None else [flag, text])
    assert all(getattr(config, field) == value for config in cli.configs(args))
    default = cli.configs(lenet.parser().parse_args([]))[0]
    assert getattr(default, field) != value


def test_every_trainconfig_field_has_a_flag_value_to_try():
    per_run = {"devices", "batch_size", "lr", "options", "model"}
    assert set(FLAG_VALUES) == {f.name for f in dataclasses.fields(TrainConfig)} - per_run


def test_each_run_of_several_writes_its_events_in_a_folder_of_its_own():
    from experiments.runs import logdir_of

    config = TrainConfig(devices=2, batch_size=64, lr=0.2)
    assert logdir_of(None, config, 2) is None and logdir_of("tb", config, 1) == "tb"
    assert logdir_of("tb", config, 2) == "tb/devices2-bs64-lr0.2"


def test_tcmalloc_is_preloaded_ahead_of_what_ld_preload_holds():
    """Catches the user's LD_PRELOAD replaced by tcmalloc's when a command re-executes itself."""
    from experiments import process

    if not os.path.exists(process.TCMALLOC):
        pytest.skip("tcmalloc is not installed (make setup installs Debian's libtcmalloc-minimal4)")
    env = {k: v for k, v in os.environ.items() if k != "JAX_DP_NO_TCMALLOC"}
    env["LD_PRELOAD"] = "/lib/x86_64-linux-gnu/libc.so.6"
    out = subprocess.run([sys.executable, "-c", "from experiments import process; "
                          "process.with_tcmalloc(); import os; print(os.environ['LD_PRELOAD'])"],
                         capture_output=True, text=True, timeout=60, env=env,
                         cwd=Path(__file__).parents[1])
    assert out.stdout.strip() == f"{process.TCMALLOC}:/lib/x86_64-linux-gnu/libc.so.6", out.stderr
