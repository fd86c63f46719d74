"""Where does a training step's time go, convolution by convolution, against PyTorch's ops?

Run: `python -m experiments.profile --model lenet --peer torch` times one single-device step
of batch 256 under the model's XLA options (docs/speed.md), then each op inside it (XLA:CPU's
profiler events), each convolution of the compiled step alone, and PyTorch's step under its
profiler, grouped the same way.
"""

from __future__ import annotations

from pathlib import Path

from experiments import cli, outputs, process, xla_options


def main(args) -> None:
    """Profile both, print the tables, write --json."""
    outputs.check_writable(args.json)
    if args.pairs and args.peer != "torch":
        raise ValueError("--pairs alternates jax_dp's step with PyTorch's: add --peer torch")
    xla_options.use(args.model)
    from jax_dp import assembly
    from experiments.measure import op_times

    options = {}
    ours = op_times.step_profile(assembly.make_model(args.model, **options), args.batch_size,
                                args.repeats)
    peer = None
    if args.peer == "torch":
        from experiments.measure import torch_peer

        peer = torch_peer.step_profile(args.model, args.batch_size, args.repeats)
    print(table(args.model, args.batch_size, ours, peer))
    alternated = alternated_steps(args.model, options, args.batch_size, args.pairs) \
        if args.pairs else None
    if alternated:
        print(f"\nthe two steps in turns, {args.pairs} pairs: jax_dp "
              f"{alternated['jax_s_median']:.3f} s, PyTorch {alternated['torch_s_median']:.3f} s, "
              f"ratio {alternated['ratio_median']:.2f}x (median of the pairs' ratios)")
    outputs.write_json(args.json, {"model": args.model, "batch_size": args.batch_size,
                               "jax": ours, "torch": peer, "alternated": alternated})


def alternated_steps(model: str, options: dict, batch_size: int, pairs: int) -> dict:
    """jax_dp's single-device step and PyTorch's, in turns in this process: each pair's ratio
    is then measured at one moment of the host, whatever its load."""
    import jax
    import numpy as np

    from jax_dp import assembly
    from experiments.measure import timing, op_times, torch_peer

    compiled, *arguments = timing.single_step(assembly.make_model(model, **options), batch_size)
    ours, theirs = op_times.alternate(lambda: jax.block_until_ready(compiled(*arguments)),
                                     torch_peer.step_on_zeros(model, batch_size), pairs)
    return {"jax_s": ours, "torch_s": theirs, "jax_s_median": float(np.median(ours)),
            "torch_s_median": float(np.median(theirs)),
            "ratio_median": float(np.median(np.divide(ours, theirs)))}


def table(model: str, batch_size: int, ours: dict, peer: dict | None) -> str:
    """Markdown: time per kind of work, then jax_dp's convolutions, slowest first."""
    lines = [f"{model}, one device, batch {batch_size}: ms per step",
             "", "| work | jax_dp | PyTorch |", "|---|---:|---:|"]
    for kind, ms in ours["by_kind"].items():
        theirs = "-"
        if peer and kind in peer["by_kind"]:
            theirs = f"{peer['by_kind'][kind]:.1f}"
        elif peer and kind.startswith("conv d"):
            theirs = "(in conv backward)" if kind == "conv dX" else \
                f"{peer['by_kind']['conv backward']:.1f} (dX + dW)"
        lines.append(f"| {kind} | {ms:.1f} | {theirs} |")
    theirs = f"{peer['step_ms']:.1f}" if peer else "-"
    lines += [f"| **step** | **{ours['step_ms']:.1f}** | **{theirs}** |", "",
              f"Inside the step ({ours['traced_ms']:.1f} ms under XLA:CPU's profiler): the wall "
              "time each op's events cover, by HLO op name; convolutions run asynchronously, so "
              "they are what the rest leaves", "",
              "| work | ms per step |", "|---|---:|"]
    lines += [f"| {kind} | {ms:.1f} |" for kind, ms in ours["in_step"].items() if abs(ms) >= 0.05]
    lines += ["",
              "| convolution | input | kernel | output | ms alone | GFLOP/s |",
              "|---|---|---|---|---:|---:|"]
    for c in ours["convs"]:
        lines.append(f"| {c['kind']} | {c['lhs']} | {c['rhs']} | {c['out']} | {c['ms']:.1f} "
                     f"| {c['gflops']:.0f} |")
    return "\n".join(lines)


def parser():
    """This experiment's flags."""
    p = cli.parser(__spec__.name, __doc__)
    p.add_argument("--model", default="lenet", choices=["lenet", "resnet18"])
    p.add_argument("--batch-size", type=cli.at_least(1), default=256, help="images per step")
    p.add_argument("--repeats", type=cli.at_least(1), default=5,
                   help="timed runs of each; figures are medians")
    p.add_argument("--peer", choices=["torch"], help="also profile PyTorch's step")
    p.add_argument("--pairs", type=cli.at_least(0), default=0,
                   help="then time jax_dp's step and PyTorch's in turns, this many of each")
    p.add_argument("--json", type=Path, help="write both profiles here")
    return p


if __name__ == "__main__":
    process.run(main, parser)
