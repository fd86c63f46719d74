"""Time every formulation of each convolution pass of a model, per layer, and choose the fastest.

Run: `python -m experiments.conv_passes --model lenet --write` traces the model's training step
to find its convolution layers (at --batch-size per device), times each formulation of each pass
of each layer on one device (jax_dp.xla_cpu.passes.FORMULATIONS; the forward pass alone, dX and dW
beside the forward formulation chosen, as in a step), and prints the times. A formulation is
chosen where it beats XLA's convolution by --margin; then the whole training step is timed with
and without the model's choices (--step-rounds, alternating), and they are kept only if the step
gains by --margin too. --write puts them in the table, jax_dp/xla_cpu/passes.json (or --table),
for this platform (and removes the model's layers that keep XLA's convolution). Run it again on
another CPU, or on a GPU, to make that machine's table.
"""

from __future__ import annotations

from pathlib import Path

from experiments import cli, process, xla_options


def layers(model_name: str, options: dict, batch_size: int) -> list[tuple]:
    """(x shape, w shape, strides, pads) of each distinct convolution of the model's step."""
    import jax
    from jax import lax

    from experiments.measure import timing
    from jax_dp import models, step as step_lib
    from jax_dp.xla_cpu import passes

    seen, tracing = {}, [False]

    def recording(x, w, strides, padding, *args, **kwargs):
        if tracing[0]:  # Only the step's convolutions (a model's init traces its own).
            pads = tuple(lax.padtype_to_pads(x.shape[1:3], w.shape[:2], strides, padding)
                         if isinstance(padding, str) else map(tuple, padding))
            shapes = (x.shape, w.shape, tuple(strides), pads)
            seen.setdefault(passes.layer_key(*shapes), shapes)
        return lax.conv_general_dilated(x, w, strides, padding, *args, **kwargs)

    model = models.get_model(model_name, convolution=recording, **options)
    state = timing.sgd_state(model, shapes=True)[1]
    batch = {"image": jax.ShapeDtypeStruct((batch_size, 28, 28, 1), "float32"),
             "label": jax.ShapeDtypeStruct((batch_size,), "int32"),
             "mask": jax.ShapeDtypeStruct((batch_size,), "float32")}
    tracing[0] = True
    timing.single(model)[0].lower("train", state, jax.eval_shape(step_lib.zero_metrics), batch)
    return list(seen.values())


def time_passes(layer: tuple, repeats: int, margin: float) -> dict:
    """pass -> formulation -> median seconds, each formulation compiled alone; dX's and dW's
    beside the chosen forward pass (their time with it, less its time alone), as in a step,
    where XLA computes what they share with it (the input's windows) once."""
    import jax
    import numpy as np
    from jax import lax

    from experiments.measure.timing import median_s
    from jax_dp.xla_cpu import conv
    from jax_dp.xla_cpu.passes import FORMULATIONS

    x_shape, w_shape, strides, pads = layer
    rng = np.random.default_rng(0)
    w = jax.device_put(rng.normal(size=w_shape).astype(np.float32))
    out = jax.eval_shape(lambda x: lax.conv_general_dilated(x, w, strides, pads,
                                                            dimension_numbers=conv.CANONICAL),
                         jax.ShapeDtypeStruct(x_shape, "float32"))
    g = jax.device_put(rng.normal(size=out.shape).astype(np.float32))
    x = jax.device_put(rng.normal(size=x_shape).astype(np.float32))
    one = jax.device_put(np.float32(1))
    calls = {"forward": lambda f, x, g: f(x, w, strides, pads),
             "dx": lambda f, x, g: f(g, w, x_shape[1:3], strides, pads),
             "dw": lambda f, x, g: f(x, g, w_shape[:2], strides, pads)}
    passes = {"forward": conv.FORWARD, "dx": conv.DX, "dw": conv.DW}

    def timed(*fs):
        # The activations come out of a fusion (x * s, s a runtime 1), as in a step: XLA folds
        # a transpose of an entry parameter into the convolution's layout, which a step never
        # sees and which runs dW's convolution about 15x slower.
        fn = jax.jit(lambda x, g, s: [call(f, x * s, g * s) for call, f in fs])
        jax.block_until_ready(fn(x, g, one))
        return median_s(lambda: jax.block_until_ready(fn(x, g, one)), repeats)

    times = {"forward": {f: timed((calls["forward"], conv.FORWARD[f]))
                         for f in FORMULATIONS["forward"]}}
    chosen = choose(times, margin).get("forward", "conv")
    forward, alone = (calls["forward"], conv.FORWARD[chosen]), times["forward"][chosen]
    for name in ("dx", "dw"):
        times[name] = {f: timed(forward, (calls[name], passes[name][f])) - alone
                       for f in FORMULATIONS[name]}
    return times


def choose(times: dict, margin: float) -> dict:
    """pass -> the fastest formulation, where it beats XLA's convolution by margin."""
    chosen = {}
    for name, by in times.items():
        best = min(by, key=by.get)
        if best != "conv" and by[best] < by["conv"] * (1 - margin):
            chosen[name] = best
    return chosen


def with_entries(table: dict, platform: str, entries: dict) -> dict:
    """table with platform's entries for these layers replaced (an empty entry removes its
    layer; other layers and platforms stay)."""
    merged = {**table, platform: {**table.get(platform, {}), **entries}}
    merged = {p: {k: v for k, v in t.items() if v} for p, t in merged.items()}
    return {p: t for p, t in merged.items() if t}


def step_ratios(model_name: str, options: dict, batch_size: int, platform: str, entries: dict,
                rounds: int, table: dict, steps: int = 10) -> list[float]:
    """Per round, the model's training step (one device, real batches) with entries in table
    over the step with XLA's convolution for those layers, the two timed in turn."""
    from jax_dp import data, devices, models
    from experiments.measure.timing import time_steps
    from jax_dp.xla_cpu.conv import convolution

    split = data.load_fashion_mnist("train", limit=steps * batch_size)
    batches = list(data.batches(split, batch_size))
    tables = [with_entries(table, platform, {k: {} for k in entries}),
              with_entries(table, platform, entries)]
    ratios = []
    for _ in range(rounds):
        seconds = []
        for passes in tables:
            model = models.get_model(model_name, convolution(options["conv_grads"], platform,
                                                             passes), **options)
            seconds.append(time_steps(model, "pmap", devices.get_devices(1), batches,
                                      repeats=1)["step_s"][0])
        ratios.append(seconds[1] / seconds[0])
    return ratios


def step_gains(ratios: list[float], margin: float) -> bool:
    """Whether the rounds' median step with the entries beats the step without by margin."""
    import numpy as np

    return bool(np.median(ratios) < 1 - margin)


def write_table(path: Path, platform: str, entries: dict) -> None:
    """Replace these layers' entries for platform in the table at path."""
    from jax_dp.xla_cpu import passes

    passes.write(with_entries(passes.table(path), platform, entries), path)


def main(args) -> None:
    """Find the layers, time each pass, print, and write the table with --write."""
    from jax_dp import models

    options = models.model_options(args.model, cli.options_from_flags(args))
    xla_options.use(args.model)
    import jax

    from jax_dp.xla_cpu import passes

    platform = jax.default_backend()
    print(f"{args.model} on {platform}, {args.batch_size} images per device, median of "
          f"{args.repeats}\n\n| layer (input, kernel, strides, padding) | pass | formulation | ms | chosen |\n"
          "|---|---|---|---:|---|")
    entries = {}
    for layer in layers(args.model, options, args.batch_size):
        key = passes.layer_key(*layer)
        times = time_passes(layer, args.repeats, args.margin)
        chosen = choose(times, args.margin)
        for name, by in times.items():
            for formulation, seconds in by.items():
                mark = "yes" if chosen.get(name, "conv") == formulation else ""
                print(f"| {key} | {name} | {formulation} | {seconds * 1e3:.2f} | {mark} |", flush=True)
        entries[key] = chosen
    if args.step_rounds and any(entries.values()):
        ratios = step_ratios(args.model, options, args.batch_size, platform, entries,
                             args.step_rounds, passes.table(args.table))
        print(f"\nthe whole step with these choices / with XLA's convolution, {args.step_rounds} "
              f"round(s): {', '.join(f'{r:.3f}' for r in ratios)}")
        if not step_gains(ratios, args.margin):
            print(f"the step does not gain by --margin {args.margin}: these layers keep XLA's "
                  "convolution")
            entries = {key: {} for key in entries}
    if args.write:
        write_table(args.table, platform, entries)
        print(f"\nwrote {args.table} for {platform}")


def parser():
    p = cli.parser("experiments.conv_passes", __doc__)
    model = cli.chosen_model("lenet")
    p.add_argument("--model", default="lenet", help="a model name or module path")
    cli.add_option_flags(p, model)
    p.add_argument("--batch-size", type=cli.at_least(1), default=256, help="images per device")
    p.add_argument("--repeats", type=cli.at_least(1), default=20,
                   help="timed calls per formulation")
    p.add_argument("--margin", type=cli.fraction, default=0.05,
                   help="a formulation replaces XLA's convolution only when this much faster")
    p.add_argument("--step-rounds", type=cli.at_least(0), default=3,
                   help="rounds timing the whole training step with and without the choices; "
                        "they are kept only if the step gains by --margin (0: no check)")
    p.add_argument("--write", action="store_true", help="write the choices into --table")
    from jax_dp.xla_cpu import passes

    p.add_argument("--table", type=Path, default=passes.PATH,
                   help="the pass table to read and write (default: jax_dp/xla_cpu/passes.json)")
    return p


if __name__ == "__main__":
    process.run(main, parser)
