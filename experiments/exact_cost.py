"""What the exact mode costs: its step beside the normal one, on 1 and 2 devices, in one process.

Run: `python -m experiments.exact_cost --model resnet18 --batch-size 128 --steps 5`. For each
device count, normal and exact alternate for --rounds rounds; each timing is the mean step over
--steps real Fashion-MNIST batches (pmap, the model's XLA options, one warm-up step first).
"""

from __future__ import annotations

from pathlib import Path

from experiments import cli, outputs, process, xla_options


def main(args) -> None:
    """Time both modes, print the table, write the JSON."""
    from jax_dp import assembly, data, devices, models
    from jax_dp.config import MICRO_BATCHES, check_exact

    outputs.check_writable(args.json)
    options = models.model_options(args.model, cli.options_from_flags(args))
    for k in args.devices:
        check_exact("pmap", "psum", k)
    xla_options.use(args.model)
    devices.setup_devices(args.devices)
    import numpy as np

    from experiments.measure.timing import time_exact

    model = assembly.make_model(args.model, **options)
    split = data.load_fashion_mnist("train", limit=args.steps * args.batch_size)
    batches = list(data.batches(split, args.batch_size, pad_to=MICRO_BATCHES))
    rows = []
    for k in args.devices:
        normal, exact = time_exact(model, devices.get_devices(k), batches, args.rounds)
        rows.append({"devices": k, "normal_step_s": normal, "exact_step_s": exact,
                     "ratio": [e / n for e, n in zip(exact, normal)],
                     "median_ratio": float(np.median(np.divide(exact, normal)))})
    result = {"model": args.model, "options": options, "batch_size": args.batch_size,
              "steps": args.steps, "rounds": args.rounds, "rows": rows}
    print(table(result))
    outputs.write_json(args.json, result)


def table(result: dict) -> str:
    """The timings as a Markdown table, one row per device count."""
    lines = [f"{result['model']}, global batch {result['batch_size']}, pmap, mean step over "
             f"{result['steps']} steps, {result['rounds']} rounds alternating", "",
             "| devices | normal step | exact step | exact / normal, each round | median |",
             "|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        span = lambda xs: f"{min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f} ms"  # noqa: E731
        lines.append(f"| {row['devices']} | {span(row['normal_step_s'])} | "
                     f"{span(row['exact_step_s'])} | {', '.join(f'{r:.2f}' for r in row['ratio'])} "
                     f"| {row['median_ratio']:.2f} |")
    return "\n".join(lines)


def parser():
    p = cli.parser("experiments.exact_cost", __doc__)
    model = cli.chosen_model("lenet")
    p.add_argument("--model", default="lenet", help="a model name or module path")
    cli.add_option_flags(p, model)
    p.add_argument("--devices", type=cli.comma_list(int, "device counts"), default=[1, 2],
                   help="device counts, each dividing 8 (the exact mode's micro-batches)")
    p.add_argument("--batch-size", type=cli.at_least(1), default=256, help="global batch size")
    p.add_argument("--steps", type=cli.at_least(1), default=20, help="timed steps per timing")
    p.add_argument("--rounds", type=cli.at_least(1), default=3,
                   help="normal/exact alternations per device count")
    p.add_argument("--json", type=Path, help="write the timings here")
    return p


if __name__ == "__main__":
    process.run(main, parser)
