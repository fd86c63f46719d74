"""The scaling experiment's measurements, each in fresh processes pinned to their cores.

A worker is `python -m experiments.measure.step_costs SPEC`: SPEC (JSON) says what to time
("kind": compute, devices or processes), on which cores, and the file to write its JSON to
("out"); spawn starts one (several processes: wired by experiments.launch) and reads it back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments import xla_options
from jax_dp.backends import ALLREDUCES


def measure(model: str, batch: int, steps: int, repeats: int, sizes: list[int],
            device_counts: list[int], processes: int, cpus: list[int]) -> dict:
    """Every measurement the cost model needs, each in its own process(es)."""
    base = {"model": model, "steps": steps, "repeats": repeats, "batch_size": batch, "sizes": sizes}
    counts = sorted(set(device_counts))
    per_device = sorted({batch // k for k in counts + [processes or 1]} | {batch, batch // 2})
    compute = {}
    for cores in sorted({1, len(cpus)}):
        compute[cores] = spawn({**base, "kind": "compute", "cpus": cpus[:cores],
                                "batches": per_device})
        print(f"measured compute on {cores} core(s)", flush=True)
    configs = {}
    for k in counts:
        configs[f"1x{k}"] = spawn({**base, "kind": "devices", "k": k, "local": k, "cpus": cpus})
        print(f"measured 1 process x {k} device(s)", flush=True)
    if processes > 1:
        configs[f"{processes}x1"] = spawn({**base, "kind": "processes", "k": processes,
                                           "cpus": [[c] for c in cpus[:processes]]}, processes)
        print(f"measured {processes} processes x 1 device", flush=True)
        # Its step only: the all-reduces over gloo are fitted from processes x 1 device.
        configs[f"{processes}x2"] = spawn({**base, "kind": "processes", "k": 2 * processes,
                                           "local": 2, "sizes": [],
                                           "cpus": [[c] for c in cpus[:processes]]}, processes)
        print(f"measured {processes} processes x 2 devices", flush=True)
    return {"compute": compute, "configs": configs}


def message_sizes(grad_bytes: int, count: int) -> list[int]:
    """Up to count all-reduce sizes (bytes of whole floats), log-spaced from 4 KB to grad_bytes."""
    import numpy as np

    return sorted({int(4 * round(s / 4)) for s in np.geomspace(4096, grad_bytes, count)})


def shapes(names) -> dict:
    """Each named model's FLOPs per image of a training step (XLA's count) and gradient bytes."""
    from experiments.measure import timing
    from jax_dp import assembly, models

    return {name: {"flops_per_image": timing.step_flops(assembly.make_model(name), 64) / 64,
                   "grad_bytes": models.param_bytes(name)} for name in names}


def cpu_name() -> str:
    """This machine's CPU model, from /proc/cpuinfo."""
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def spawn(spec: dict, processes: int = 1) -> dict:
    """Run worker(spec) in new processes (several: wired by experiments.launch); its result."""
    from experiments.launch import launch

    with tempfile.TemporaryDirectory() as tmp:
        spec = {**spec, "out": f"{tmp}/out.json"}
        command = [sys.executable, "-m", __spec__.name, json.dumps(spec)]
        env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
        if processes > 1:
            with open(f"{tmp}/log", "w") as log:
                code = launch(command, processes, env=env, stdout=log, stderr=subprocess.STDOUT)
            output = Path(f"{tmp}/log").read_text()
        else:
            proc = subprocess.run(command, capture_output=True, text=True, env=env)
            code, output = proc.returncode, proc.stderr
        if code:
            raise ValueError(f"scaling worker {spec['kind']} failed: "
                             f"{(output.strip().splitlines() or ['no output'])[-1]}")
        return json.loads(Path(spec["out"]).read_text())


def worker(spec: dict) -> None:
    """Measure what spec asks for in this (fresh) process."""
    rank = int(os.environ.get("JAX_PROCESS_ID", 0))
    cpus = spec["cpus"][rank] if spec["kind"] == "processes" else spec["cpus"]
    os.sched_setaffinity(0, cpus)  # Before JAX starts: XLA sizes its thread pool from this.
    xla_options.use(spec["model"], show=False)
    from experiments.measure import timing
    from jax_dp import assembly, devices, distributed

    devices.simulate_cpu_devices(spec.get("local", 1))
    if spec["kind"] == "processes":
        distributed.initialize()
    model = assembly.make_model(spec["model"])
    if spec["kind"] == "compute":
        result = {str(b): timing.time_compute(model, b, spec["steps"], spec["repeats"])
                  for b in spec["batches"]}
    else:
        result = measure_devices(spec, model, devices.get_devices(spec["k"]))
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(result))


def measure_devices(spec: dict, model, devs) -> dict:
    """All-reduce times by scheme and size, the fixed cost and real step times on devs."""
    import numpy as np

    from experiments.measure import timing
    from jax_dp import data

    several = len(devs) > 1
    allreduces = [{"scheme": s, "bytes": n, "seconds": timing.time_allreduce(s, n // 4, devs)}
                  for s in ALLREDUCES for n in spec["sizes"]] if several else []
    split = data.load_fashion_mnist("train", limit=spec["steps"] * spec["batch_size"])
    timed = timing.time_steps(model, "pmap", devs,
                                 list(data.batches(split, spec["batch_size"])), spec["repeats"])
    return {"allreduce": allreduces,
            "fixed_s": timing.time_fixed(model, devs, spec["batch_size"]),
            "step_s": float(np.median(timed["step_s"])),
            "arrays": timing.allreduced_arrays(model, devs, spec["batch_size"]) if several
            else 0}


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
