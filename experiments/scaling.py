"""When does data parallelism pay? Measure compute, all-reduce and fixed costs here, fit a cost
model, check its predictions against real steps, and draw it for the machines in a hardware file.

Run: `python -m experiments.scaling --model lenet` measures, each in a fresh process:
(a) the step's compute against the per-device batch on one device (many steps per compiled call,
no collective), with 1 core and with all of them; (b) psum, ring and star all-reduces from 4 KB to
the model's gradient size over 2 and 4 simulated devices in one process and over 2 processes
(jax.distributed, gloo on loopback); (c) a step's fixed cost (a call that does no work). It fits
an alpha-beta link per transport, predicts the step time of 1 process x 1, 2, 4 devices and 2
processes x 1 device (each on its own core), times those steps, and draws speedup curves of
LeNet and ResNet-18 up to 64 devices for the profiles of --profiles.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments import cli, process
from jax_dp.backends import ALLREDUCES
from jax_dp.config import SIZES

HERE = Path(__file__).parent
DEFAULTS = {"lenet": {"batch_size": 256, "steps": 20}, "resnet18": {"batch_size": 64, "steps": 2}}
BOOK = {"lenet": {"batch_size": 256, "lr": 0.2, "weak": False, "seconds": {1: 1.6, 2: 2.4}},
        "resnet18": {"batch_size": 256, "lr": 0.1, "weak": True, "seconds": {1: 13.6, 2: 7.0}}}
CURVE_DEVICES = (1, 2, 4, 8, 16, 32, 64)


# --- Workers: each runs in its own process, pinned to its cores, and writes JSON to spec["out"].

def worker(spec: dict) -> None:
    """Measure what spec asks for in this (fresh) process."""
    rank = int(os.environ.get("JAX_PROCESS_ID", 0))
    cpus = spec["cpus"][rank] if spec["kind"] == "processes" else spec["cpus"]
    os.sched_setaffinity(0, cpus)  # Before JAX starts: XLA sizes its thread pool from this.
    cli.use_xla_options(spec["model"], show=False)
    from jax_dp import devices, distributed, models
    from experiments.measure import benchmark

    devices.simulate_cpu_devices(spec.get("local", 1))
    if spec["kind"] == "processes":
        distributed.initialize()
    model = models.get_model(spec["model"])
    if spec["kind"] == "compute":
        result = {str(b): benchmark.time_compute(model, b, spec["steps"], spec["repeats"])
                  for b in spec["batches"]}
    else:
        result = measure_devices(spec, model, devices.get_devices(spec["k"]))
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(result))


def measure_devices(spec: dict, model, devs) -> dict:
    """All-reduce times by scheme and size, the fixed cost and real step times on devs."""
    import numpy as np

    from jax_dp import data
    from experiments.measure import benchmark

    allreduces = [{"scheme": s, "bytes": n, "seconds": benchmark.time_allreduce(s, n // 4, devs)}
                  for s in ALLREDUCES for n in spec["sizes"]] if len(devs) > 1 else []
    split = data.load_fashion_mnist("train", limit=spec["steps"] * spec["batch_size"])
    timed = benchmark.time_steps(model, "pmap", devs, list(data.batches(split, spec["batch_size"])),
                                 spec["repeats"])
    return {"allreduce": allreduces, "fixed_s": benchmark.time_fixed(model, devs, spec["batch_size"]),
            "step_s": float(np.median(timed["step_s"])),
            "arrays": benchmark.allreduced_arrays(model, devs, spec["batch_size"]) if len(devs) > 1 else 0}


def spawn(spec: dict, processes: int = 1) -> dict:
    """Run worker(spec) in new processes (several: wired by experiments.launch); its result."""
    from experiments.launch import launch

    with tempfile.TemporaryDirectory() as tmp:
        spec = {**spec, "out": f"{tmp}/out.json"}
        command = [sys.executable, "-m", "experiments.scaling", "--worker", json.dumps(spec)]
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


# --- The experiment.

def main(args) -> None:
    """Measure, fit, check the predictions, then draw the profiles' curves."""
    import numpy as np

    from jax_dp import devices, models
    from experiments.measure import hardware

    profiles = hardware.load_profiles(args.profiles)
    cli.check_writable(args.json)
    cli.check_writable(args.plot, plot=True)
    d = DEFAULTS[args.model]
    batch, steps, repeats = args.batch_size or d["batch_size"], args.steps or d["steps"], args.repeats
    for k in args.devices:
        devices.check_count(k)
    if args.processes == 1 or args.processes < 0:
        raise ValueError(f"--processes must be 0 (skip) or at least 2, got {args.processes}")
    cpus = sorted(os.sched_getaffinity(0))
    if args.processes > len(cpus):
        raise ValueError(f"--processes {args.processes} needs a core each; this machine gives "
                         f"{len(cpus)}: pass {len(cpus)} or fewer (0 to skip)")
    if any(batch % k for k in args.devices + [args.processes or 1, 2 * args.processes or 1]):
        raise ValueError(f"--batch-size {batch} must split evenly over every --devices and "
                         "--processes count")
    grad = models.param_bytes(args.model)
    sizes = sorted({int(4 * round(s / 4)) for s in np.geomspace(4096, grad, args.sizes)})
    measured = measure(args.model, batch, steps, repeats, sizes, args.devices, args.processes, cpus)
    result = analyse(args.model, batch, grad, measured, len(cpus), profiles)
    result.update(command="python -m " + " ".join([__spec__.name] + sys.argv[1:]), steps=steps,
                  repeats=repeats, cpu=cpu_name(), cores=len(cpus))
    print(report(result))
    cli.write_json(args.json, result)
    if args.plot:
        from experiments.measure import plots

        plots.plot_scaling(result, args.plot)


def measure(model: str, batch: int, steps: int, repeats: int, sizes: list[int],
            device_counts: list[int], processes: int, cpus: list[int]) -> dict:
    """Every measurement the model needs, each in its own process(es)."""
    base = {"model": model, "steps": steps, "repeats": repeats, "batch_size": batch, "sizes": sizes}
    counts = sorted(set(device_counts))
    per_device = sorted({batch // k for k in counts + [processes or 1]} | {batch, batch // 2})
    compute = {}
    for cores in sorted({1, len(cpus)}):
        compute[cores] = spawn({**base, "kind": "compute", "cpus": cpus[:cores], "batches": per_device})
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


def analyse(model: str, batch: int, grad: int, measured: dict, cores: int, profiles: dict) -> dict:
    """Fit lines and links, predict every measured config, and draw every profile's curves."""
    from jax_dp import models
    from experiments.measure import benchmark, scaling

    lines = {c: scaling.fit_line([int(b) for b in t], list(t.values()))
             for c, t in measured["compute"].items()}
    samples = {}  # transport -> scheme -> [(messages, bytes, seconds)]
    for name, m in measured["configs"].items():
        transport, _, k = scaling.layout(name)
        for a in m["allreduce"]:
            messages, sent = scaling.busiest_link(a["scheme"], a["bytes"], k)
            samples.setdefault(transport, {}).setdefault(a["scheme"], []).append((messages, sent, a["seconds"]))
    links = {t: {s: scaling.fit_link(*zip(*points)) for s, points in by.items()}
             for t, by in samples.items()}
    checks = []
    for name, m in measured["configs"].items():
        transport, processes, k = scaling.layout(name)
        # One device alone uses every core of its process (XLA:CPU's intra-op threads). Several
        # run side by side, a core each, taking turns where there are more devices than cores;
        # each process of several has one core of its own. gloo runs between processes.
        local, own_cores = k // processes, cores if processes == 1 else 1
        compute = lines[cores](batch) if k == 1 else \
            math.ceil(local / own_cores) * lines[1](batch / k)
        link = links.get(transport, {}).get("psum")
        comm = scaling.allreduce_s(link, "psum", grad, processes if processes > 1 else k,
                                   m["arrays"]) if link else 0.0
        predicted = {o: scaling.step_s(compute, comm, m["fixed_s"], overlap=o) for o in (False, True)}
        checks.append({"config": name, "devices": k, "processes": processes, "compute_s": compute,
                       "arrays": m["arrays"], "allreduce_s": comm, "fixed_s": m["fixed_s"], "measured_s": m["step_s"],
                       "predicted_s": predicted[False], "predicted_overlap_s": predicted[True],
                       "error": predicted[False] / m["step_s"] - 1})
    shapes = {name: {"flops_per_image": benchmark.step_flops(models.get_model(name), 64) / 64,
                     "grad_bytes": models.param_bytes(name)} for name in BOOK}
    return {"model": model, "batch_size": batch, "grad_bytes": grad, "measured": measured,
            "lines": {str(c): line._asdict() for c, line in lines.items()},
            "links": {t: {s: link._asdict() for s, link in by.items()} for t, by in links.items()},
            "checks": checks, "shapes": shapes, "profiles": curves(profiles, shapes),
            "book": book(profiles["v100-pcie"], shapes) if "v100-pcie" in profiles else None}


def curves(profiles: dict, shapes: dict) -> dict:
    """Each profile's predicted speedups up to 64 devices (both models at the book's batch of
    256, weak and strong scaling, with and without overlap) and its crossover batches."""
    from experiments.measure import scaling

    out = {}
    for key, hw in profiles.items():
        out[key] = {"name": hw.name}
        for name, s in shapes.items():
            step = {o: hw.step(s["flops_per_image"], s["grad_bytes"], overlap=o) for o in (False, True)}
            out[key][name] = {
                f"{'weak' if weak else 'strong'}{'_overlap' if o else ''}":
                    [scaling.speedup(step[o], BOOK[name]["batch_size"], k, weak) for k in CURVE_DEVICES]
                for weak in (True, False) for o in (False, True)}
            out[key][name]["min_batch"] = {
                k: scaling.min_batch(s["flops_per_image"] / hw.flops,
                                     scaling.allreduce_s(hw.link(k), "ring", s["grad_bytes"], k),
                                     hw.fixed_s) for k in (2, 8, 64)}
    return out


def book(hw, shapes: dict) -> dict:
    """The book's epoch times (1 and 2 GPUs) against the model on a V100-over-PCIe profile: as
    the profile stands, and with a per-step offset that makes its 1-GPU time the book's."""
    out = {}
    for name, b in BOOK.items():
        s = shapes[name]
        step = hw.step(s["flops_per_image"], s["grad_bytes"])

        def epoch(k, fixed=0.0):
            per_device, global_batch = (b["batch_size"], b["batch_size"] * k) if b["weak"] else \
                (b["batch_size"] / k, b["batch_size"])
            return math.ceil(SIZES["train"] / global_batch) * (step(per_device, k) + fixed)
        extra = b["seconds"][1] / math.ceil(SIZES["train"] / b["batch_size"]) - step(b["batch_size"], 1)
        out[name] = {"book_s": b["seconds"], "profile_s": {k: epoch(k) for k in (1, 2)},
                     "offset_s": extra,
                     "calibrated_s": {k: epoch(k, extra) for k in (1, 2)}}
    return out


def report(r: dict) -> str:
    """The checks, the fitted parts and the crossovers as Markdown tables."""
    lines = [f"{r['model']}, global batch {r['batch_size']}, gradients {r['grad_bytes'] / 1e6:.2f} MB, "
             f"{r['cores']} cores ({r['cpu']})", "",
             "| config | compute s | all-reduce s | fixed s | predicted s | overlapped s | measured s | error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in r["checks"]:
        lines.append(f"| {c['processes']} process(es) x {c['devices'] // c['processes']} device(s) "
                     f"| {c['compute_s']:.4f} | {c['allreduce_s']:.4f} | {c['fixed_s']:.4f} "
                     f"| {c['predicted_s']:.4f} | {c['predicted_overlap_s']:.4f} "
                     f"| {c['measured_s']:.4f} | {100 * c['error']:+.0f}% |")
    lines += ["", "| transport | scheme | alpha (us per message) | bandwidth (GB/s) |", "|---|---|---:|---:|"]
    for t, by in r["links"].items():
        for s, link in by.items():
            bw = f"{1e-9 / link['beta']:.2f}" if link["beta"] > 0 else "-"
            lines.append(f"| {t} | {s} | {1e6 * link['alpha']:.1f} | {bw} |")
    lines += ["", "| cores | compute s = a + b x per-device batch | a (ms) | b (ms per image) |",
              "|---:|---|---:|---:|"]
    for c, line in r["lines"].items():
        lines.append(f"| {c} | fitted | {1e3 * line['intercept']:.2f} | {1e3 * line['slope']:.3f} |")
    lines += ["", "Per-device batch at which k devices reach half of k times one device's "
              "throughput (weak scaling, ring, no overlap):", "",
              "| profile | model | k=2 | k=8 | k=64 |", "|---|---|---:|---:|---:|"]
    for key, p in r["profiles"].items():
        for name in BOOK:
            mb = p[name]["min_batch"]
            lines.append(f"| {key} | {name} | " + " | ".join(
                f"{math.ceil(mb[k])}" if mb[k] > 0 else "any" for k in (2, 8, 64)) + " |")
    if r["book"]:
        lines += ["", "| book (V100 PCIe), s per epoch | 1 GPU | 2 GPUs | model, profile as is | "
                  "model, per-step offset fitted to 1 GPU |", "|---|---:|---:|---:|---:|"]
        for name, b in r["book"].items():
            lines.append(f"| {name} | {b['book_s'][1]} | {b['book_s'][2]} | "
                         f"{b['profile_s'][1]:.2f} / {b['profile_s'][2]:.2f} | "
                         f"{b['calibrated_s'][1]:.2f} / {b['calibrated_s'][2]:.2f} |")
    return "\n".join(lines)


def cpu_name() -> str:
    """This machine's CPU model, from /proc/cpuinfo."""
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def parser():
    """This experiment's flags."""
    p = cli.parser(__spec__.name, __doc__)
    p.add_argument("--model", default="lenet", choices=sorted(DEFAULTS))
    p.add_argument("--devices", type=cli.comma_list(int, "counts"), default="1,2,4",
                   help="simulated device counts in one process to measure and predict")
    p.add_argument("--processes", type=int, default=2,
                   help="also measure this many processes x 1 device, each on its own core (0: skip)")
    p.add_argument("--batch-size", type=cli.at_least(2),
                   help="global batch size (default: lenet 256, resnet18 64)")
    p.add_argument("--steps", type=cli.at_least(1),
                   help="steps per timed run (default: lenet 20, resnet18 2)")
    p.add_argument("--repeats", type=cli.at_least(1), default=3,
                   help="timed runs; figures are their medians")
    p.add_argument("--sizes", type=cli.at_least(2), default=6,
                   help="all-reduce message sizes, 4 KB to the gradients'")
    p.add_argument("--profiles", type=Path, default=HERE / "hardware.json",
                   help="hardware profiles (JSON) to draw speedup curves for")
    p.add_argument("--json", type=Path, help="write every measurement and prediction here")
    p.add_argument("--plot", type=Path, help="write a PNG of the checks and the profiles' curves here")
    return p


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(json.loads(sys.argv[2]))
        sys.exit(0)
    process.run(main, parser)
