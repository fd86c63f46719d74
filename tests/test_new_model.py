"""A model of one's own: one module, trained, resumed and compared through the command line."""

import json
import os

import pytest

from helpers import forked_commands

from jax_dp import assembly, models, train
from jax_dp.config import TrainConfig
from jax_dp.errors import ParamError

MLP = "tests.tiny_mlp"  # tests/tiny_mlp.py, importable from the repository's root.
FLAGS = ["--model", MLP, "--hidden", "16", "--train-examples", "2048", "--test-examples", "256",
         "--batch-size", "64", "--no-progress"]


def cli(*runs):
    """Each run's flags to `python -m experiments.train`, in order, from one interpreter."""
    return forked_commands(tuple(("experiments.train", *flags) for flags in runs),
                           dict(os.environ))


def untimed(path):
    return [{k: v for k, v in e.items() if k != "time_s"}
            for run in json.loads(path.read_text())["runs"] for e in run["epochs"]]


def test_a_model_module_trains_on_k_devices_and_resumes_through_the_cli(tmp_path):
    straight, resumed, ckpt = tmp_path / "straight.json", tmp_path / "resumed.json", tmp_path / "ckpt"
    first, one_epoch, proc = cli(
        (*FLAGS, "--devices", "2", "--epochs", "2", "--json", str(straight)),
        (*FLAGS, "--devices", "2", "--epochs", "1", "--checkpoint-dir", str(ckpt)),
        (*FLAGS, "--devices", "2", "--epochs", "2", "--checkpoint-dir", str(ckpt), "--resume",
         "--json", str(resumed)))
    assert first.returncode == 0, first.stderr
    assert f"config: model={MLP} hidden=16 activation=relu backend=pmap" in first.stdout
    assert one_epoch.returncode == 0, one_epoch.stderr
    assert proc.returncode == 0, proc.stderr
    assert "at epoch 2, step 0" in proc.stdout
    assert untimed(resumed) == untimed(straight)
    assert untimed(straight)[-1]["test_acc"] > 0.5  # It learns: 10 classes, chance is 0.1.


def test_its_options_are_flags_and_a_bad_value_is_one_line():
    helped, refused, proc = cli(("--model", MLP, "--help"), ("--model", MLP, "--hidden", "48"),
                                ("--model", "tests.no_such_model"))
    assert helped.returncode == 0 and "--hidden {16,32,64}" in helped.stdout
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "argument --hidden: invalid choice: '48'" in refused.stderr
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "cannot import --model 'tests.no_such_model'" in proc.stderr


def test_one_registry_line_gives_it_a_short_name(monkeypatch):
    monkeypatch.setitem(models.MODELS, "mlp", MLP)
    assert models.model_options("mlp") == {"hidden": "32", "activation": "relu"}
    with pytest.raises(ParamError, match="unknown hidden '8': use one of 16, 32, 64"):
        assembly.make_model("mlp", hidden="8")
    params, state = assembly.make_model("mlp", hidden="64").init(__import__("jax").random.key(0))
    assert params["w1"].shape == (784, 64) and state == {}
    assert TrainConfig(model="mlp").model == "mlp"
    assert train  # The run loop needs nothing else: the CLI test above trains it.
