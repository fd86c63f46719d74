"""How fast is training here, against PyTorch on the same machine, batches and allocator?

Run: `python -m experiments.benchmark --model lenet --peer torch` times every training path
(LeNet: the readable lax.conv and the im2col fast path) on 1, 2, 4 and 8 simulated devices,
each in a fresh process, beside PyTorch and the machine's measured float32 matmul ceiling.
Figures are medians of --repeats runs of --steps steps; compile time is reported apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from experiments import cli, outputs, process
from jax_dp.config import SIZES

# How each model's convolutions can be written (its model options).
FORMULATIONS = {"lenet": {"readable": {"conv": "xla"}, "im2col": {"conv": "im2col"}},
                "resnet18": {"canonical": {}}}
DEFAULTS = {"lenet": {"devices": "1,2,4,8", "steps": 100, "batch_size": 256},
            "resnet18": {"devices": "1,2", "steps": 3, "batch_size": 256}}


def paths(model: str) -> dict[str, tuple[dict, str]]:
    """name -> (model options, XLA_FLAGS): every formulation under every YNNPACK fusion set."""
    from jax_dp.xla_cpu.flags import FUSIONS

    return {f"{form}/{fusion}": (options, flags) for form, options in FORMULATIONS[model].items()
            for fusion, flags in FUSIONS.items()}


def worker(spec: dict) -> dict:
    """Time one configuration in this (fresh) process; returns its measurements."""
    from jax_dp import data

    split = data.load_fashion_mnist("train", limit=spec["steps"] * spec["batch_size"])
    batches = list(data.batches(split, spec["batch_size"]))
    if spec["kind"] == "torch":
        from experiments.measure import torch_peer

        return torch_peer.time_steps(spec["model"], batches, spec["repeats"], threads=os.cpu_count())
    from jax_dp import assembly, devices
    from experiments.measure import timing

    devices.simulate_cpu_devices(spec["devices"])
    model = assembly.make_model(spec["model"], **spec["options"])
    result = timing.time_steps(model, "pmap", devices.get_devices(spec["devices"]), batches,
                                  spec["repeats"])
    return {**result, "flops_per_step": timing.step_flops(model, spec["batch_size"])}


def flags_for(fusions: str) -> str:
    """XLA_FLAGS for a path: the user's, with the path's YNNPACK fusion set in place of theirs."""
    from jax_dp.xla_cpu.flags import YNN_FUSION, flag_names, without

    user = without(os.environ.get("XLA_FLAGS", ""), flag_names(YNN_FUSION))
    return " ".join(filter(None, [fusions, user]))


def spawn(spec: dict, xla_flags: str | None = None) -> dict:
    """Run worker(spec) in a new Python process (its own device count; these XLA_FLAGS)."""
    env = {**os.environ, **({"XLA_FLAGS": xla_flags} if xla_flags is not None else {})}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    proc = subprocess.run([sys.executable, "-m", "experiments.benchmark", "--worker", json.dumps(spec)],
                          capture_output=True, text=True, env=env)
    if proc.returncode:
        raise ValueError(f"benchmark worker {spec} failed: {proc.stderr.strip().splitlines()[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(args) -> None:
    """Time every path and device count (and the peer), then print and save the table."""
    import numpy as np

    from experiments.measure import timing

    outputs.check_writable(args.json)
    outputs.check_writable(args.plot, plot=True)
    d = DEFAULTS[args.model]
    devices = args.devices or cli.comma_list(int, "counts")(d["devices"])
    steps, batch_size = args.steps or d["steps"], args.batch_size or d["batch_size"]
    if min(devices) < 1:
        raise ValueError(f"--devices must be at least 1, got {min(devices)}")
    known = paths(args.model)
    chosen = args.paths or list(known)
    unknown = set(chosen) - set(known)
    if unknown:
        raise ValueError(f"unknown --paths {sorted(unknown)} for {args.model}: use {', '.join(known)}")
    ceiling = timing.matmul_ceiling()
    print(f"float32 matmul ceiling (numpy, 2048^2): {ceiling:.0f} GFLOP/s; "
          f"allocator: {os.environ.get('LD_PRELOAD') or 'glibc malloc'}", flush=True)
    base = {"model": args.model, "steps": steps, "batch_size": batch_size, "repeats": args.repeats}
    rows = []
    if args.peer == "torch":
        result = spawn({**base, "kind": "torch"})
        rows.append({"path": f"pytorch {result['version']}", "devices": 1, **result})
        print(f"measured {rows[-1]['path']}", flush=True)
    for path in chosen:
        options, fusions = known[path]
        flags = flags_for(fusions)
        for k in devices:
            result = spawn({**base, "kind": "jax", "options": options, "devices": k}, flags)
            rows.append({"path": f"jax {path}", "devices": k, "xla_flags": flags, **result})
            print(f"measured jax {path} on {k} device(s)", flush=True)
    flops = next(r["flops_per_step"] for r in rows if "flops_per_step" in r)
    peer = next((r for r in rows if r["path"].startswith("pytorch")), None)
    for row in rows:
        step_s = float(np.median(row["step_s"]))
        row.update(step_s_median=step_s, images_per_s=batch_size / step_s,
                   epoch_s=SIZES["train"] / batch_size * step_s,
                   fraction_of_ceiling=flops / step_s / 1e9 / ceiling)
        if peer:
            row["time_vs_peer"] = step_s / float(np.median(peer["step_s"]))
    result = {**base, "matmul_ceiling_gflops": ceiling, "flops_per_step": flops, "runs": rows}
    print(table(result))
    outputs.write_json(args.json, result)
    if args.plot:
        from experiments.measure import plots

        plots.plot_benchmark(result, args.plot)


def table(result: dict) -> str:
    """The measurements as a Markdown table."""
    per = "epoch (60k images)" if result["model"] == "lenet" else f"step (batch {result['batch_size']})"
    lines = [f"{result['model']}, global batch {result['batch_size']}, median of {result['repeats']} "
             f"x {result['steps']} steps; ceiling {result['matmul_ceiling_gflops']:.0f} GFLOP/s",
             "", f"| path | devices | images/s | s per {per} | compile s | % of matmul ceiling "
             "| time vs PyTorch |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["runs"]:
        seconds = r["epoch_s"] if result["model"] == "lenet" else r["step_s_median"]
        compile_s = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
        ratio = f"{r['time_vs_peer']:.2f}x" if "time_vs_peer" in r else "-"
        lines.append(f"| {r['path']} | {r['devices']} | {r['images_per_s']:.0f} | {seconds:.2f} "
                     f"| {compile_s} | {100 * r['fraction_of_ceiling']:.0f}% | {ratio} |")
    return "\n".join(lines)


def parser():
    """This experiment's flags."""
    p = cli.parser(__spec__.name, __doc__)
    p.add_argument("--model", default="lenet", choices=sorted(FORMULATIONS))
    p.add_argument("--devices", type=cli.comma_list(int, "counts"),
                   help="simulated device counts (default: lenet 1,2,4,8; resnet18 1,2)")
    p.add_argument("--paths", type=cli.comma_list(str, "names"),
                   help="training paths, formulation/fusions (default: all; lenet: readable or "
                        "im2col, resnet18: canonical; fusions: ynn-default, ynn-dots, ynn-noconv)")
    p.add_argument("--steps", type=cli.at_least(1),
                   help="steps per timed run (default: lenet 100, resnet18 3)")
    p.add_argument("--repeats", type=cli.at_least(1), default=3,
                   help="timed runs; figures are their median")
    p.add_argument("--batch-size", type=cli.at_least(1), help="global batch size (default 256)")
    p.add_argument("--peer", choices=["torch"], help="also time PyTorch (pip install -e '.[bench]')")
    p.add_argument("--json", type=Path, help="write every measurement here")
    p.add_argument("--plot", type=Path, help="write a PNG of throughput against devices here")
    return p


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(worker(json.loads(sys.argv[2]))))
        sys.exit(0)
    process.run(main, parser)
