"""The scaling experiment's report: its checks, fitted parts and crossovers as Markdown tables,
and as a figure."""

from __future__ import annotations

import math
from pathlib import Path

from experiments.measure import plots, cost_model
from experiments.measure.cost_model import BOOK, CURVE_DEVICES


def markdown(r: dict) -> str:
    """The checks, the fitted parts and the crossovers as Markdown tables."""
    lines = [f"{r['model']}, global batch {r['batch_size']}, "
             f"gradients {r['grad_bytes'] / 1e6:.2f} MB, {r['cores']} cores ({r['cpu']})", "",
             "| config | compute s | all-reduce s | fixed s | predicted s | overlapped s "
             "| measured s | error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in r["checks"]:
        lines.append(f"| {c['processes']} process(es) x {c['devices'] // c['processes']} device(s) "
                     f"| {c['compute_s']:.4f} | {c['allreduce_s']:.4f} | {c['fixed_s']:.4f} "
                     f"| {c['predicted_s']:.4f} | {c['predicted_overlap_s']:.4f} "
                     f"| {c['measured_s']:.4f} | {100 * c['error']:+.0f}% |")
    lines += ["", "| transport | scheme | alpha (us per message) | bandwidth (GB/s) |",
              "|---|---|---:|---:|"]
    for t, by in r["links"].items():
        for s, link in by.items():
            bw = f"{1e-9 / link['beta']:.2f}" if link["beta"] > 0 else "-"
            lines.append(f"| {t} | {s} | {1e6 * link['alpha']:.1f} | {bw} |")
    lines += ["", "| cores | compute s = a + b x per-device batch | a (ms) | b (ms per image) |",
              "|---:|---|---:|---:|"]
    for c, line in r["lines"].items():
        lines.append(f"| {c} | fitted | {1e3 * line['intercept']:.2f} "
                     f"| {1e3 * line['slope']:.3f} |")
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


def plot(result: dict, path: Path) -> None:
    """A PNG of this machine's measured parts and checks (top) and each profile's predicted
    speedups (bottom)."""
    plt = plots.pyplot()
    fig, axes = plt.subplots(2, 4, figsize=(20, 8.5))
    compute, allreduce, checks, book = axes[0]
    for cores, times in result["measured"]["compute"].items():
        b = sorted(int(x) for x in times)
        line = cost_model.Line(**result["lines"][str(cores)])
        compute.plot(b, [times[str(x)] for x in b], "o",
                     label=f"{cores} core(s), measured")
        compute.plot(b, [line(x) for x in b], "-", color=compute.lines[-1].get_color(), label="fit")
    compute.set(xlabel="per-device batch", ylabel="s per step", title="(a) compute, one device")
    compute.legend(fontsize="small")
    for name, m in result["measured"]["configs"].items():
        transport, _, k = cost_model.layout(name)
        for scheme in ("psum", "ring", "star"):
            points = sorted((a["bytes"], a["seconds"]) for a in m["allreduce"]
                            if a["scheme"] == scheme)
            if not points:
                continue
            link = cost_model.Link(**result["links"][transport][scheme])
            allreduce.loglog(*zip(*points), "o", ms=4, label=f"{scheme}, {transport}, k={k}")
            fitted = [max(cost_model.allreduce_s(link, scheme, n, k), 1e-7) for n, _ in points]
            allreduce.loglog([n for n, _ in points], fitted, "-",
                             color=allreduce.lines[-1].get_color())
    allreduce.set(xlabel="message bytes", ylabel="s per all-reduce",
                  title="(b) all-reduce: measured (dots), alpha-beta fit (lines)")
    allreduce.legend(fontsize="x-small", ncol=2)
    names = [c["config"].replace("x", " proc x ") + " dev" for c in result["checks"]]
    x = range(len(names))
    for shift, key, label in ((-0.2, "predicted_s", "predicted"), (0.2, "measured_s", "measured")):
        checks.bar([i + shift for i in x], [c[key] for c in result["checks"]], 0.4, label=label)
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
    ks = CURVE_DEVICES
    panels = [(n, w) for n in ("lenet", "resnet18") for w in ("weak", "strong")]
    for ax, (name, kind) in zip(axes[1], panels):
        for key, p in result["profiles"].items():
            ax.plot(ks, p[name][kind], "-o", ms=3, label=key)
            ax.plot(ks, p[name][f"{kind}_overlap"], "--", color=ax.lines[-1].get_color())
        ax.plot(ks, ks, ":", color="grey", label="ideal")
        ax.set(xscale="log", yscale="log", xlabel="devices", ylabel="speedup over 1 device",
               title=f"{name}, batch 256 {'per device' if kind == 'weak' else 'in all'} ({kind}); "
                     "dashed: overlap")
        ax.legend(fontsize="x-small")
    plots.save(plt, fig, path)
