"""A batch that cannot fit is refused before its first step, in one line naming one that would;
an out-of-memory error that still happens is one line too."""

import os
import subprocess
import sys
from pathlib import Path
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


def per_device(b):
    """A step's bytes a device at global batch b: 0.5 GiB fixed, 2 MiB a row."""
    return 2**29 + b * 2**21


def test_cpu_devices_share_the_hosts_memory_and_the_batch_named_fits(monkeypatch):
    """Catches one device's need compared with the whole host, or a suggestion that does not
    fit: 4 CPU devices at batch 1024 (2.5 GiB each) against 6 GiB the host has free. The
    suggestion is measured (needs_at), not scaled: a step's fixed part does not shrink."""
    monkeypatch.setattr(memory, "free_bytes", lambda device: memory.Room(6 * 2**30, "the host has free"))
    step, asked = compiled(per_device(1024) - 1000), []

    def needs_at(b):
        asked.append(b)
        return per_device(b)
    memory.check_fits([step], [CPU] * 2, 1024, 8, needs_at)  # 5 GiB: fits.
    with pytest.raises(ParamError) as e:
        memory.check_fits([compiled(10), step], [CPU] * 4, 1024, 8, needs_at)
    fits = int(str(e.value).split("pass batch_size ")[1].split()[0])
    assert str(e.value) == ("batch_size 1024 needs about 10.0 GiB a step on 4 device(s), more "
                            f"than the 6.0 GiB the host has free: pass batch_size {fits} or smaller")
    assert e.value.params == ("batch_size", "batch_size")
    assert fits % 8 == 0 and 4 * per_device(fits) <= memory.MARGIN * 6 * 2**30
    assert 4 * per_device(fits + 8) > memory.MARGIN * 6 * 2**30  # The largest that does.
    assert asked[-1] == fits and len(asked) <= 3  # A line through two measured points.


def test_a_step_whose_fixed_part_alone_does_not_fit_says_so(monkeypatch):
    monkeypatch.setattr(memory, "free_bytes", lambda device: memory.Room(2**30, "the host has free"))
    with pytest.raises(ParamError, match=r"^batch_size 64 needs about 5.0 GiB a step on 2 device\(s\), "
                                         r"more than the 1.0 GiB the host has free: even batch_size "
                                         r"8 does not fit: pass fewer --devices, or free memory$"):
        memory.check_fits([compiled(5 * 2**29)], [CPU] * 2, 64, 8, lambda b: 2**30 + b)


def test_the_room_is_the_least_of_free_memory_the_cgroup_and_the_address_space(monkeypatch):
    monkeypatch.setattr(memory, "meminfo_bytes", lambda field: 9 * 2**30)
    monkeypatch.setattr(memory, "cgroup_room", lambda: 3 * 2**30)
    monkeypatch.setattr(memory, "address_room", lambda: None)
    assert memory.host_room() == (3 * 2**30, "its memory cgroup allows")
    monkeypatch.setattr(memory, "address_room", lambda: 2**30)
    assert memory.host_room() == (2**30, "its address-space limit allows")


@pytest.mark.parametrize("version", [1, 2])
def test_a_cgroups_room_is_its_limit_less_its_usage_and_a_parents_limit_counts(tmp_path, version):
    """Catches the host's free memory trusted inside a container: cgroup v1 and v2 layouts, the
    process in a child of a limited cgroup, the root unlimited."""
    names = {1: ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "4:memory:/job/step"),
             2: ("", "memory.max", "memory.current", "0::/job/step")}[version]
    base = tmp_path / names[0]
    for folder, limit, usage in ((base, "max" if version == 2 else str(2**63 - 4096), "0"),
                                 (base / "job", str(3 * 2**30), str(2**30)),
                                 (base / "job" / "step", "max" if version == 2 else str(2**63 - 4096),
                                  str(2**29))):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / names[1]).write_text(limit + "\n")
        (folder / names[2]).write_text(usage + "\n")
    cgroups = tmp_path / "cgroup"
    cgroups.write_text(f"9:cpu:/\n{names[3]}\n")
    assert memory.cgroup_room(tmp_path, cgroups) == 2 * 2**30
    cgroups.write_text("9:cpu:/\n")
    assert memory.cgroup_room(tmp_path, cgroups) is None


def test_an_accelerator_is_charged_per_device(monkeypatch):
    gpu = SimpleNamespace(platform="gpu", device_kind="H100")
    monkeypatch.setattr(memory, "free_bytes", lambda device: memory.Room(3 * 2**30, "H100 has free"))
    memory.check_fits([compiled(2 * 2**30)], [gpu] * 4, 256, 4)
    with pytest.raises(ParamError, match="more than the 3.0 GiB H100 has free: pass batch_size"):
        memory.check_fits([compiled(4 * 2**30)], [gpu] * 4, 256, 4, lambda b: b * 2**24)
    with pytest.raises(ParamError, match="more than the 3.0 GiB H100 has free: pass a smaller "
                                         "batch_size$"):  # Nothing to measure a batch with.
        memory.check_fits([compiled(4 * 2**30)], [gpu] * 4, 256, 4)


def test_the_hosts_free_memory_respects_an_address_space_limit():
    limit = 6 * 2**30
    code = ("import resource; from jax_dp import memory; "
            f"resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit})); "
            "from types import SimpleNamespace as S; print(memory.free_bytes(S(platform='cpu')).bytes)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    assert out.returncode == 0, out.stderr
    assert 0 < int(out.stdout) < limit


def limited(gib, *command):
    """command under an address-space limit of gib GiB (set by the shell: no fork of this,
    multithreaded, process)."""
    return ["bash", "-c", f'ulimit -v {gib * 2**20} && exec "$0" "$@"', *command]


def suggested(stderr: str) -> int:
    return int(stderr.split("pass --batch-size ")[1].split()[0])


def test_a_batch_that_cannot_fit_is_refused_in_one_line_and_the_one_named_trains():
    """LeNet at batch 60,000 on 8 devices within 8 GiB of address space: without the check,
    XLA:CPU's allocation failed in C++ (std::bad_alloc, exit 134, no line); the batch the check
    once named from a linear guess failed so too. The one it names now trains under that limit."""
    lenet = [sys.executable, "-m", "experiments.lenet", "--devices", "8", "--epochs", "1",
             "--test-examples", "1000", "--no-progress"]
    proc = subprocess.run(limited(8, *lenet, "--batch-size", "60000"),
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("python -m experiments.lenet: error: --batch-size 60000 needs "
                                  "about "), proc.stderr
    assert "GiB its address-space limit allows: pass --batch-size " in proc.stderr
    assert "epoch 1" not in proc.stdout
    fits = suggested(proc.stderr)
    proc = subprocess.run(limited(8, *lenet, "--batch-size", str(fits), "--train-examples", str(fits)),
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0 and "epoch 1, time" in proc.stdout, proc.stderr[-2000:]


CGROUPS = Path("/sys/fs/cgroup/memory")  # cgroup v1's memory controller, where it is mounted.


@pytest.fixture
def cgroup(tmp_path):
    """A command runner inside a fresh memory cgroup (v1) of a given limit."""
    if not (os.geteuid() == 0 and (CGROUPS / "cgroup.procs").exists()):
        pytest.skip("a memory cgroup needs root and cgroup v1's memory controller")
    made = []

    def run(limit_gib, *command):
        folder = CGROUPS / f"jax-dp-test-{os.getpid()}-{len(made)}"
        folder.mkdir()
        made.append(folder)
        (folder / "memory.limit_in_bytes").write_text(str(int(limit_gib * 2**30)))
        enter = f'echo $$ > {folder}/cgroup.procs && exec "$0" "$@"'
        return subprocess.run(["sh", "-c", enter, *command], capture_output=True, text=True,
                              timeout=600, env=ENV)
    yield run
    for folder in made:
        folder.rmdir()


def test_a_memory_cgroups_limit_is_honoured_and_2_gib_train_lenet(cgroup):
    """Inside a 3 GiB cgroup (how Docker and Kubernetes limit memory), LeNet at batch 20,000 on
    2 devices passed the check against the host's free memory and was killed by the kernel (no
    line); a 4 GiB reserve refused every run under 4 GiB free. Now the batch is refused naming
    the cgroup, the batch named trains there, and LeNet's book run trains within 2 GiB."""
    lenet = [sys.executable, "-m", "experiments.lenet", "--devices", "2", "--epochs", "1",
             "--test-examples", "1000", "--no-progress"]
    proc = cgroup(3, *lenet, "--batch-size", "20000", "--train-examples", "20000")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "GiB its memory cgroup allows: pass --batch-size " in proc.stderr, proc.stderr
    fits = suggested(proc.stderr)
    proc = cgroup(3, *lenet, "--batch-size", str(fits), "--train-examples", str(fits))
    assert proc.returncode == 0 and "epoch 1, time" in proc.stdout, proc.stderr[-2000:]
    proc = cgroup(2, *lenet, "--train-examples", "2048")
    assert proc.returncode == 0 and "epoch 1, time" in proc.stdout, proc.stderr[-2000:]


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
