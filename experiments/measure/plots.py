"""PNG figures of runs (matplotlib, the optional `plot` extra)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install -e '.[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def check_format(path: Path) -> None:
    """Refuse a plot path whose suffix is no format matplotlib writes (none: PNG)."""
    plt = _pyplot()
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    suffix = Path(path).suffix[1:].lower()
    if suffix and suffix not in formats:
        raise ValueError(f"--plot {path}: matplotlib cannot write .{suffix} files: use one of "
                         + ", ".join(f".{f}" for f in sorted(formats)))


def _label(run: dict) -> str:
    return f"{run.get('backend', 'pmap')} x{run['devices']}"


def plot_parity(result: dict, path: Path) -> None:
    """Divergence from the single-device reference over steps, and throughput against k."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for run in result["runs"]:
        if "per_step_max_rel_diff" in run:
            steps = range(1, len(run["per_step_max_rel_diff"]) + 1)
            left.semilogy(steps, [max(d, 1e-17) for d in run["per_step_max_rel_diff"]],
                          marker=".", label=_label(run))
    left.set(xlabel="step", ylabel="max relative |params - reference| (0 drawn at 1e-17)",
             title=f"{result['model']}: k devices vs 1 ({result['dtype']})")
    left.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    left.legend(fontsize="small", ncol=2)
    single = next(r for r in result["runs"] if r["backend"] == "single")
    _throughput(plt, right, _by(result["runs"], "backend", skip="single"),
                {"single (jit)": single["images_per_s"]}, "throughput")
    _save(plt, fig, path)


def plot_history(payload: dict, path: Path) -> None:
    """Per-epoch training loss and test accuracy per run, and epoch time per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for run in payload["runs"]:
        epochs = [e["epoch"] for e in run["epochs"]]
        c = run["config"]
        label = f"{c['devices']} device(s), bs {c['batch_size']}, lr {c['lr']}"
        axes[0].plot(epochs, [e["train_loss"] for e in run["epochs"]], marker="o", label=label)
        axes[1].plot(epochs, [e["test_acc"] for e in run["epochs"]], marker="o", label=label)
    labels = [f"{r['config']['devices']} dev\nbs {r['config']['batch_size']}" for r in payload["runs"]]
    times = [sum(e["time_s"] for e in r["epochs"]) / len(r["epochs"]) for r in payload["runs"]]
    axes[2].bar(range(len(times)), times, tick_label=labels)
    for ax in axes[:2]:
        ax.set_xticks(sorted({e["epoch"] for r in payload["runs"] for e in r["epochs"]}))
    axes[0].set(xlabel="epoch", ylabel="train loss", title=payload["model"])
    axes[1].set(xlabel="epoch", ylabel="test accuracy", title="test accuracy")
    axes[2].set(ylabel="seconds per epoch", title="epoch time")
    axes[0].legend()
    _save(plt, fig, path)


def plot_benchmark(result: dict, path: Path) -> None:
    """Images/s against device count, one line per training path, PyTorch as a line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    jax_runs = [r for r in result["runs"] if r["path"].startswith("jax")]
    peers = {r["path"]: r["images_per_s"] for r in result["runs"] if r["path"].startswith("pytorch")}
    _throughput(plt, ax, _by(jax_runs, "path"), peers,
                f"{result['model']} training, batch {result['batch_size']}")
    _save(plt, fig, path)


def _by(runs: list[dict], key: str, skip: str | None = None) -> dict[str, list[dict]]:
    """Runs grouped by run[key] (in first-seen order), each group sorted by device count."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        if run[key] != skip:
            groups.setdefault(run[key], []).append(run)
    return {name: sorted(g, key=lambda r: r["devices"]) for name, g in groups.items()}


def _throughput(plt, ax, groups: dict[str, list[dict]], baselines: dict[str, float], title: str):
    """Images/s against device count (log axis), a line per group, a dashed line per baseline."""
    for name, runs in groups.items():
        ax.plot([r["devices"] for r in runs], [r["images_per_s"] for r in runs], marker="o",
                label=name)
    for name, images_per_s in baselines.items():
        ax.axhline(images_per_s, color="gray", linestyle="--", label=name)
    ax.set(xlabel="devices", ylabel="images/s", xscale="log", title=title)
    ax.set_xticks(sorted({r["devices"] for runs in groups.values() for r in runs}))
    ax.get_xaxis().set_major_formatter(plt.ScalarFormatter())
    ax.get_xaxis().set_minor_formatter(plt.NullFormatter())
    ax.legend()


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    part = Path(path).with_name(Path(path).name + ".part")  # Replaced in one step: never half a file.
    fig.savefig(part, dpi=120, format=Path(path).suffix[1:] or "png")
    plt.close(fig)
    part.replace(path)


def plot_scaling(result: dict, path: Path) -> None:
    """This machine's measured parts and checks (top), each profile's predicted speedups (bottom)."""
    from experiments.measure import scaling

    plt = _pyplot()
    fig, axes = plt.subplots(2, 4, figsize=(20, 8.5))
    compute, allreduce, checks, book = axes[0]
    for cores, times in result["measured"]["compute"].items():
        b = sorted(int(x) for x in times)
        line = scaling.Line(**result["lines"][str(cores)])
        compute.plot(b, [times[str(x)] for x in b], "o",
                     label=f"{cores} core(s), measured")
        compute.plot(b, [line(x) for x in b], "-", color=compute.lines[-1].get_color(), label="fit")
    compute.set(xlabel="per-device batch", ylabel="s per step", title="(a) compute, one device")
    compute.legend(fontsize="small")
    for name, m in result["measured"]["configs"].items():
        transport, _, k = scaling.layout(name)
        for scheme in ("psum", "ring", "star"):
            points = sorted((a["bytes"], a["seconds"]) for a in m["allreduce"] if a["scheme"] == scheme)
            if not points:
                continue
            link = scaling.Link(**result["links"][transport][scheme])
            allreduce.loglog(*zip(*points), "o", ms=4, label=f"{scheme}, {transport}, k={k}")
            allreduce.loglog([n for n, _ in points], [max(scaling.allreduce_s(link, scheme, n, k), 1e-7)
                                                      for n, _ in points], "-",
                             color=allreduce.lines[-1].get_color())
    allreduce.set(xlabel="message bytes", ylabel="s per all-reduce",
                  title="(b) all-reduce: measured (dots), alpha-beta fit (lines)")
    allreduce.legend(fontsize="x-small", ncol=2)
    names = [c["config"].replace("x", " proc x ") + " dev" for c in result["checks"]]
    x = range(len(names))
    checks.bar([i - 0.2 for i in x], [c["predicted_s"] for c in result["checks"]], 0.4, label="predicted")
    checks.bar([i + 0.2 for i in x], [c["measured_s"] for c in result["checks"]], 0.4, label="measured")
    checks.set_xticks(list(x), names, fontsize="small")
    checks.set(ylabel="s per step", title=f"(c) {result['model']}, batch {result['batch_size']}: "
               "model vs measurement")
    checks.legend(fontsize="small")
    if result.get("book"):
        rows = [(f"{n} {k} GPU", b["book_s"][k], b["profile_s"][k], b["calibrated_s"][k])
                for n, b in result["book"].items() for k in (1, 2)]
        x = range(len(rows))
        for shift, col, label in ((-0.27, 1, "book"), (0, 2, "model, profile"),
                                  (0.27, 3, "model, per-step offset fitted to 1 GPU")):
            book.bar([i + shift for i in x], [r[col] for r in rows], 0.27, label=label)
        book.set_xticks(list(x), [r[0] for r in rows], fontsize="small")
        book.set(ylabel="s per epoch", title="(d) the book's tables, V100 over PCIe")
        book.legend(fontsize="small")
    ks = [1, 2, 4, 8, 16, 32, 64]
    for ax, (name, kind) in zip(axes[1], [(n, w) for n in ("lenet", "resnet18") for w in ("weak", "strong")]):
        for key, p in result["profiles"].items():
            ax.plot(ks, p[name][kind], "-o", ms=3, label=key)
            ax.plot(ks, p[name][f"{kind}_overlap"], "--", color=ax.lines[-1].get_color())
        ax.plot(ks, ks, ":", color="grey", label="ideal")
        ax.set(xscale="log", yscale="log", xlabel="devices", ylabel="speedup over 1 device",
               title=f"{name}, batch 256 {'per device' if kind == 'weak' else 'in all'} ({kind}); "
                     "dashed: overlap")
        ax.legend(fontsize="x-small")
    _save(plt, fig, path)
