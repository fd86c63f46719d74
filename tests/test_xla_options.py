"""The XLA:CPU options the experiments set: the measured choice, a user's own flags winning."""

import os
import subprocess
import sys

import pytest

from experiments import xla_options
from jax_dp import models
from jax_dp.xla_cpu import flags as fusion_flags
from jax_dp.xla_cpu.flags import YNN_FUSION


CHOSEN = fusion_flags.MODEL_FUSIONS


@pytest.mark.parametrize("model", sorted(models.MODELS))
def test_the_chosen_flags_are_set_when_the_user_sets_none(model):
    assert xla_options.flags_for(model, "") == fusion_flags.FUSIONS[CHOSEN[model]]
    assert CHOSEN == {"lenet": "ynn-dots", "resnet18": "ynn-noconv"}  # docs/speed.md's choice.
    assert xla_options.flags_for("tests.tiny_mlp", "") == fusion_flags.FUSIONS["ynn-default"]


def test_a_users_own_setting_of_a_chosen_flag_wins_and_other_flags_stay():
    user = f"--xla_cpu_use_onednn=true {YNN_FUSION}=individual_convolution"
    for model in ("lenet", "resnet18", "tests.tiny_mlp"):
        assert fusion_flags.cpu_flags(model, user).split() == user.split()


@pytest.mark.parametrize("user", [f"-{YNN_FUSION.lstrip('-')}=individual_convolution",
                                  f'--xla_dump_to="/tmp/a  b" {YNN_FUSION}=dot --xla_cpu_use_onednn'])
def test_the_users_string_is_kept_as_written(user):
    """Catches a merge that re-splits the user's quoted values or misses a single-dash flag."""
    for model in ("lenet", "resnet18", "tests.tiny_mlp"):
        assert fusion_flags.cpu_flags(model, user) == user


def test_chosen_flags_come_before_the_users_other_flags(monkeypatch):
    """Catches a choice that drops the user's flags, or is dropped although the user did not set it."""
    monkeypatch.setitem(fusion_flags.MODEL_FUSIONS, "lenet", "ynn-dots")
    assert xla_options.flags_for("lenet", "--xla_cpu_use_onednn=true") == \
        f"{YNN_FUSION}=individual_dot --xla_cpu_use_onednn=true"


YNN_FUSIONS_IN_LENET_STEP = """
import functools, sys
import jax, jax.numpy as jnp, optax
from experiments import xla_options
from jax_dp import assembly, step as step_lib
if sys.argv[1] == "late":
    xla_options.use("lenet", show=False)
model, tx = assembly.make_model("lenet", conv="xla"), optax.sgd(0.1)
batch = {"image": jnp.zeros((8, 28, 28, 1)), "label": jnp.zeros(8, jnp.int32), "mask": jnp.ones(8)}
step = jax.jit(functools.partial(step_lib.train_step, model=model, tx=tx, axis_name=None))
hlo = step.lower(step_lib.init_state(model, tx, jax.random.key(0)), step_lib.zero_metrics(), batch)
print(hlo.compile().as_text().count('"kind":"__ynn_fusion"'))
"""


def test_flags_set_after_jax_is_imported_still_reach_xla():
    """Catches options set too late to count: the step compiled after use_xla_options has the
    YNNPACK fusions of the same flags given before Python starts, not those of XLA's default."""
    def fusions(when, flags):
        proc = subprocess.run([sys.executable, "-c", YNN_FUSIONS_IN_LENET_STEP, when],
                              capture_output=True, text=True, env={**os.environ, "XLA_FLAGS": flags})
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout.split()[-1])

    chosen = xla_options.flags_for("lenet", "")
    assert fusions("late", "") == fusions("early", chosen) != fusions("early", "")


@pytest.mark.parametrize("user", ["", f"{YNN_FUSION}=individual_convolution"])
def test_the_experiment_trains_with_the_flags_it_prints(tmp_path, user):
    """The experiment sets XLA_FLAGS before JAX's backend starts and says which (a user's win)."""
    env = {**os.environ, "XLA_FLAGS": user, "JAX_DP_NO_TCMALLOC": "1"}
    proc = subprocess.run([sys.executable, "-m", "experiments.lenet", "--devices", "1",
                           "--epochs", "1", "--train-examples", "64", "--test-examples", "64",
                           "--batch-size", "64"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    want = xla_options.flags_for("lenet", user) or "(none)"
    assert f"XLA_FLAGS: {want}\n" in proc.stdout


@pytest.mark.parametrize("environ, accelerator", [
    ({"JAX_PLATFORMS": "cuda"}, True), ({"JAX_PLATFORMS": "cuda,cpu"}, True),
    ({"JAX_PLATFORMS": "cpu"}, False), ({"JAX_PLATFORMS": " cpu , cuda"}, False),
    ({}, False),  # No GPU plugin in this environment.
])
def test_an_accelerator_is_told_before_jax_starts(environ, accelerator):
    assert fusion_flags.accelerator_expected(environ) is accelerator


def test_no_xla_cpu_option_is_set_for_an_accelerator():
    """Catches a CPU-measured fusion set applied on a GPU: only the user's own flags stay."""
    for model in CHOSEN:
        assert xla_options.flags_for(model, " --xla_gpu_autotune_level=0", accelerator=True) == \
            "--xla_gpu_autotune_level=0"
        assert xla_options.flags_for(model, "", accelerator=True) == ""
        assert YNN_FUSION in xla_options.flags_for(model, "")
