"""pmap on k devices vs one device: the same numbers? how fast? (a side-by-side run).

Run: `python -m experiments.compare --model lenet --devices 1,2,4,8 --steps 20` steps every
device count in lockstep from the same params on the same Fashion-MNIST batches and prints,
per k, how far its params are from the single-device jax.jit reference. LeNet stays near 1e-7
(until round-off tips a ReLU input across zero); ResNet-18 in float32 drifts as SGD magnifies
round-off; in float64 both stay below 1e-10.
"""

from __future__ import annotations

from pathlib import Path

from experiments import cli, outputs, process

# The book's models' batch and lr here; any other model: GENERIC.
DEFAULTS = {"lenet": {"batch_size": 256, "lr": 0.2}, "resnet18": {"batch_size": 16, "lr": 0.1}}
GENERIC = {"batch_size": 256, "lr": 0.1}


def main(args) -> None:
    """Run the comparison and print its table."""
    from jax_dp import assembly, data, devices, models
    from jax_dp.backends import BACKENDS
    from jax_dp.config import MICRO_BATCHES, check_exact
    from jax_dp.errors import check_choice
    from experiments.measure import divergence

    outputs.check_writable(args.json)
    outputs.check_writable(args.plot, plot=True)
    defaults = DEFAULTS.get(args.model, GENERIC)
    options = models.model_options(args.model, cli.options_from_flags(args))
    for backend in args.backends:  # Each name, and the model's own rules on each backend.
        check_choice("backends", backend, BACKENDS)
        models.model_options(args.model, options, backend)
    batch_size = args.batch_size or defaults["batch_size"]
    lr = args.lr or defaults["lr"]
    if args.exact:
        for backend in args.backends:
            for k in args.devices:
                check_exact(backend, "psum", k)
    for k in args.devices:
        if batch_size % k:
            raise ValueError(f"--batch-size {batch_size} does not split over {k} devices: "
                             "use a multiple of every device count")
    devices.setup_devices(args.devices)
    split = data.load_fashion_mnist("train", limit=args.steps * batch_size)
    if len(split.labels) < args.steps * batch_size:
        raise ValueError(f"{args.steps} steps of {batch_size} need more than "
                         f"{len(split.labels)} training examples")
    batches = list(data.batches(split, batch_size, pad_to=MICRO_BATCHES if args.exact else 1))
    dtype = {"float32": "float32", "float64": "float64"}[args.precision]
    import jax

    with jax.enable_x64(dtype == "float64"):
        result = divergence.compare(assembly.make_model(args.model, **options), batches,
                                [divergence.Config(b, k) for b in args.backends for k in args.devices],
                                lr=lr, seed=args.seed, dtype=dtype, exact=args.exact)
    result.update(model=args.model, options=options, batch_size=batch_size, lr=lr,
                  steps=args.steps, dtype=dtype, exact=args.exact)
    print(table(result))
    outputs.write_json(args.json, result)
    if args.plot:
        from experiments.measure import plots

        plots.plot_parity(result, args.plot)


def table(result: dict) -> str:
    """The comparison as a Markdown table, one row per run."""
    ref_losses = result["runs"][0]["losses"]
    options = " ".join(f"{k}={v}" for k, v in result["options"].items())
    rows = [f"{result['model']} ({options}), global batch {result['batch_size']}, "
            f"lr {result['lr']}, {result['steps']} steps, {result['dtype']}"
            f"{', exact mode' if result.get('exact') else ''}; reference: single device (jax.jit)",
            "",
            "| backend | devices | max rel diff, last step | max rel diff, any step "
            "| rel L2 diff, any step | max rel loss diff | compile s | steps/s | images/s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in result["runs"]:
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref_losses))
        last = f"{run['max_rel_diff']:.1e}" if "max_rel_diff" in run else "reference"
        worst = f"{max(run['per_step_max_rel_diff']):.1e}" if "max_rel_diff" in run else ""
        l2 = f"{max(run['per_step_rel_l2_diff']):.1e}" if "max_rel_diff" in run else ""
        rows.append(f"| {run['backend']} | {run['devices']} | {last} | {worst} | {l2} | {loss_diff:.1e} "
                    f"| {run['compile_s']:.2f} | {run['steps_per_s']:.2f} "
                    f"| {run['images_per_s']:.0f} |")
    return "\n".join(rows)


def parser():
    """This experiment's flags."""
    from jax_dp import backends

    p = cli.parser(__spec__.name, __doc__)
    model = cli.chosen_model("lenet")
    p.add_argument("--model", default="lenet", help="a model named in jax_dp.models.MODELS, or a "
                   "module path; its options have flags of their own")
    p.add_argument("--devices", type=cli.comma_list(int, "counts"), default="1,2,4,8",
                   help="device counts to compare against the single-device reference")
    p.add_argument("--backends", type=cli.comma_list(str, "names"), default="pmap",
                   help=f"backends to compare, of {', '.join(backends.BACKENDS)}")
    p.add_argument("--steps", type=cli.at_least(1), default=20, help="training steps")
    p.add_argument("--batch-size", type=cli.at_least(1),
                   help="global batch (default: lenet 256, resnet18 16, "
                   "others 256)")
    p.add_argument("--lr", type=float, help="SGD learning rate (default: lenet 0.2, resnet18 0.1, "
                   "others 0.1)")
    p.add_argument("--exact", action="store_true", help="every run in the exact mode "
                   "(jax_dp.exact): the differences are then zero")
    p.add_argument("--precision", default="float32", choices=["float32", "float64"],
                   help="float64 shows that what drift there is comes from float32 round-off")
    cli.add_option_flags(p, model)
    p.add_argument("--seed", type=int, default=0, help="seed of params and batches")
    p.add_argument("--json", type=Path, help="write the full result (per-step divergence) here")
    p.add_argument("--plot", type=Path, help="write a PNG of divergence and throughput here")
    return p


if __name__ == "__main__":
    process.run(main, parser)
