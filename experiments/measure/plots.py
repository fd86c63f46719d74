"""PNG figures of runs (matplotlib, the optional `plot` extra)."""

from __future__ import annotations

import io
from pathlib import Path

from jax_dp import files


def pyplot():
    """pyplot, drawing to files (Agg); without matplotlib, a ValueError that says how to get it."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install -e '.[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def check_format(path: Path) -> None:
    """Refuse a plot path whose suffix is no format matplotlib writes (none: PNG)."""
    plt = pyplot()
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
    plt = pyplot()
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
    save(plt, fig, path)


def plot_history(payload: dict, path: Path) -> None:
    """Per-epoch training loss and test accuracy per run, and epoch time per run."""
    plt = pyplot()
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
    save(plt, fig, path)


def plot_benchmark(result: dict, path: Path) -> None:
    """Images/s against device count, one line per training path, PyTorch as a line."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    jax_runs = [r for r in result["runs"] if r["path"].startswith("jax")]
    peers = {r["path"]: r["images_per_s"] for r in result["runs"] if r["path"].startswith("pytorch")}
    _throughput(plt, ax, _by(jax_runs, "path"), peers,
                f"{result['model']} training, batch {result['batch_size']}")
    save(plt, fig, path)


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


def save(plt, fig, path: Path) -> None:
    """Write fig to path in the format its suffix names (none: PNG), whole or not at all."""
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, dpi=120, format=Path(path).suffix[1:] or "png")
    plt.close(fig)
    files.write(Path(path), image.getvalue())
