"""A batch that cannot fit is refused before its first step, in one line naming one that would;
an out-of-memory error that still happens is one line too."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from jax_dp import memory
from jax_dp.errors import ParamError

ENV = {**os.environ, "JAX_DP_NO_TCMALLOC": "1"}


def compiled(temp, arguments=1000, outputs=100, aliased=100):
    analysis = SimpleNamespace(temp_size_in_bytes=temp, argument_size_in_bytes=arguments,
                               output_size_in_bytes=outputs, alias_size_in_bytes=aliased)
    return SimpleNamespace(memory_analysis=lambda: analysis)


CPU = SimpleNamespace(platform="cpu")


def test_a_step_is_charged_its_arguments_outputs_and_temporaries():
    assert memory.step_bytes(compiled(5000, 1000, 300, 200)) == 6100
    assert memory.step_bytes(SimpleNamespace()) is None  # A form XLA says nothing about.


def test_cpu_devices_share_the_hosts_memory_and_a_fitting_batch_is_named(monkeypatch):
    """Catches one device's need compared with the whole host, or a suggestion that does not
    fit: 4 CPU devices of 1 GiB each against 3 GiB free."""
    monkeypatch.setattr(memory, "free_bytes", lambda device: 3 * 2**30)
    step = compiled(2**30 - 1000)
    memory.check_fits([step], [CPU] * 2, 256, 8)  # 2 GiB: fits.
    with pytest.raises(ParamError) as e:
        memory.check_fits([compiled(10), step], [CPU] * 4, 256, 8)
    assert str(e.value) == ("batch_size 256 needs about 4.0 GiB a step on 4 device(s), more than "
                            "the 3.0 GiB the host has free: pass batch_size 168 or smaller")
    assert e.value.params == ("batch_size", "batch_size")
    assert 168 % 8 == 0 and 168 / 256 * 4 < 3


def test_an_accelerator_is_charged_per_device(monkeypatch):
    gpu = SimpleNamespace(platform="gpu", device_kind="H100")
    monkeypatch.setattr(memory, "free_bytes", lambda device: 3 * 2**30)
    memory.check_fits([compiled(2 * 2**30)], [gpu] * 4, 256, 4)
    with pytest.raises(ParamError, match="more than the 3.0 GiB H100 has free: pass batch_size"):
        memory.check_fits([compiled(4 * 2**30)], [gpu] * 4, 256, 4)


def test_the_hosts_free_memory_respects_an_address_space_limit():
    limit = 6 * 2**30
    code = ("import resource; from jax_dp import memory; "
            f"resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit})); "
            "from types import SimpleNamespace as S; print(memory.free_bytes(S(platform='cpu')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    assert out.returncode == 0, out.stderr
    assert 0 < int(out.stdout) < limit


def limited(gib, *command):
    """command under an address-space limit of gib GiB (set by the shell: no fork of this,
    multithreaded, process)."""
    return ["bash", "-c", f'ulimit -v {gib * 2**20} && exec "$0" "$@"', *command]


def test_a_batch_that_cannot_fit_is_refused_before_training_in_one_line():
    """LeNet at batch 60,000 on 8 devices within 8 GiB of address space: without the check,
    XLA:CPU's allocation failed in C++ (std::bad_alloc, exit 134, no line)."""
    proc = subprocess.run(limited(8, sys.executable, "-m", "experiments.lenet", "--devices", "8",
                                  "--batch-size", "60000", "--epochs", "1", "--no-progress"),
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("python -m experiments.lenet: error: --batch-size 60000 needs "
                                  "about "), proc.stderr
    assert "GiB the host has free: pass --batch-size " in proc.stderr
    assert "epoch 1" not in proc.stdout


def test_an_out_of_memory_error_during_the_run_is_one_line():
    code = ("from experiments import cli, process\n"
            "def main(args):\n"
            "    raise RuntimeError('RESOURCE_EXHAUSTED: Out of memory allocating 325928685328 "
            "bytes.\\nmore detail')\n"
            "process.run(main, lambda: cli.parser('experiments.x', 'x'))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    assert proc.returncode == 2
    assert proc.stderr == ("python -m experiments.x: error: out of memory during the run "
                           "(RESOURCE_EXHAUSTED: Out of memory allocating 325928685328 bytes.): "
                           "pass a smaller batch_size, or fewer --devices\n")
