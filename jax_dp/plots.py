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
    left.set(xlabel="step", ylabel="max relative |params - reference|",
             title=f"{result['model']}: k devices vs 1 ({result['dtype']})")
    left.legend()
    backends = sorted({r["backend"] for r in result["runs"] if r["backend"] != "single"})
    for backend in backends:
        runs = sorted((r for r in result["runs"] if r["backend"] == backend),
                      key=lambda r: r["devices"])
        right.plot([r["devices"] for r in runs], [r["images_per_s"] for r in runs], marker="o",
                   label=backend)
    single = next(r for r in result["runs"] if r["backend"] == "single")
    right.axhline(single["images_per_s"], color="gray", linestyle="--", label="single (jit)")
    right.set(xlabel="devices", ylabel="images/s", title="throughput", xscale="log", xticks=[1, 2, 4, 8])
    right.get_xaxis().set_major_formatter(plt.ScalarFormatter())
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_history(payload: dict, path: Path) -> None:
    """Per-epoch training loss and test accuracy per run, and epoch time per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for run in payload["runs"]:
        epochs = [e["epoch"] for e in run["epochs"]]
        label = f"{run['devices']} device(s), bs {run['batch_size']}, lr {run['lr']}"
        axes[0].plot(epochs, [e["train_loss"] for e in run["epochs"]], marker="o", label=label)
        axes[1].plot(epochs, [e["test_acc"] for e in run["epochs"]], marker="o", label=label)
    labels = [f"{r['devices']} dev\nbs {r['batch_size']}" for r in payload["runs"]]
    times = [sum(e["time_s"] for e in r["epochs"]) / len(r["epochs"]) for r in payload["runs"]]
    axes[2].bar(range(len(times)), times, tick_label=labels)
    for ax in axes[:2]:
        ax.set_xticks(sorted({e["epoch"] for r in payload["runs"] for e in r["epochs"]}))
    axes[0].set(xlabel="epoch", ylabel="train loss", title=payload["model"])
    axes[1].set(xlabel="epoch", ylabel="test accuracy", title="test accuracy")
    axes[2].set(ylabel="seconds per epoch", title="epoch time")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_benchmark(result: dict, path: Path) -> None:
    """Images/s against device count, one line per training path, PyTorch as a line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["path"] for r in result["runs"] if r["path"].startswith("jax")):
        runs = sorted((r for r in result["runs"] if r["path"] == name), key=lambda r: r["devices"])
        ax.plot([r["devices"] for r in runs], [r["images_per_s"] for r in runs], marker="o", label=name)
    for r in result["runs"]:
        if r["path"].startswith("pytorch"):
            ax.axhline(r["images_per_s"], color="gray", linestyle="--", label=r["path"])
    ax.set(xlabel="simulated devices", ylabel="images/s", xscale="log",
           title=f"{result['model']} training, batch {result['batch_size']}")
    ax.set_xticks(sorted({r["devices"] for r in result["runs"]}))
    ax.get_xaxis().set_major_formatter(plt.ScalarFormatter())
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
