"""What a user installs: the wheel holds jax_dp alone, trains from a fresh venv, and declares
every package jax_dp imports."""

import ast
import importlib.metadata
import re
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def declared_dependencies() -> set[str]:
    """The normalised names of pyproject.toml's runtime dependencies."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {normalised(re.split(r"[\[<>=!~; ]", spec)[0]) for spec in project["dependencies"]}


def normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def third_party_imports(package: Path) -> set[str]:
    """The top-level modules that package's files import, other than its own and the stdlib."""
    modules = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules.add(node.module.split(".")[0])
    return modules - set(sys.stdlib_module_names) - {"__future__", package.name}


def test_every_package_jax_dp_imports_is_declared():
    """Catches a dependency that arrives only through another (orbax through flax), or a
    test-only one (chex) among the runtime dependencies."""
    distributions = importlib.metadata.packages_distributions()
    imported = {normalised(distributions[module][0])
                for module in third_party_imports(ROOT / "jax_dp")}
    assert imported <= declared_dependencies(), imported - declared_dependencies()
    assert "chex" not in declared_dependencies()  # The tests' alone: declared in `test`.


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel pip builds from the checkout."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("jax_dp-*.whl")
    return built


def test_the_wheel_holds_jax_dp_alone_with_its_license(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"jax_dp", wheel.name.split("-py3")[0]
                                                     + ".dist-info"}
    assert "jax_dp/xla_cpu/passes.json" in names
    assert any(name.endswith("licenses/LICENSE") for name in names)


def test_the_wheel_trains_lenet_from_a_fresh_venv(wheel, tmp_path):
    """Installed without the checkout on the path (its dependencies read from this venv)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path("
                                "'purelib'))"], capture_output=True, text=True).stdout.strip())
    zipfile.ZipFile(wheel).extractall(site)  # What pip install --no-deps puts there.
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    script = ("import jax_dp, numpy as np\n"
              "from jax_dp import data, devices\n"
              "devices.simulate_cpu_devices(2)\n"
              "from jax_dp import train\n"
              "from jax_dp.config import TrainConfig\n"
              "rng = np.random.default_rng(0)\n"
              "split = data.Split(rng.random((64, 28, 28, 1), np.float32), "
              "rng.integers(0, 10, 64).astype(np.int32))\n"
              "run = train.train(TrainConfig(devices=2, batch_size=32, epochs=1, "
              "train_examples=64, test_examples=64), split, split, log=lambda line: None)\n"
              "print(jax_dp.__file__, run['epochs'][0]['train_loss'])\n"
              "import experiments\n")
    proc = subprocess.run([python, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    location, loss = proc.stdout.split()
    assert Path(location).is_relative_to(site) and float(loss) > 0
    assert "No module named 'experiments'" in proc.stderr  # The wheel installs no experiments.
