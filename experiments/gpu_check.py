"""One prepared check of a machine's accelerator: what it has, how fast, and do devices agree.

Run on a GPU: `python -m experiments.gpu_check --json gpu_check.json` (a few minutes). It prints
a table and writes, in one JSON: the devices and versions; LeNet at 1, 4, 16 and 64 steps per
compiled call (seconds per epoch, images per second, compile time); ResNet-18 at the book's
1-device configuration over a fixed number of steps; float32 agreement of one device with
pmap, shard_map and jit; the exact mode's cost; and peak device memory. `--quick` runs the
same with tiny sizes and a narrow ResNet (tests.tiny_resnet; on CPU, as the tests do).
"""

from __future__ import annotations

import importlib.metadata
import platform
from pathlib import Path

from experiments import cli, outputs, process

FULL = {"lenet_examples": 60_000, "lenet_batch": 256, "calls": (1, 4, 16, 64),
        "resnet": "resnet18", "resnet_batch": 256, "resnet_steps": 20, "compare_steps": 20,
        "exact_steps": 50, "exact_pairs": 3}
QUICK = {"lenet_examples": 512, "lenet_batch": 64, "calls": (1, 4),
         "resnet": "tests.tiny_resnet", "resnet_batch": 8, "resnet_steps": 2, "compare_steps": 2,
         "exact_steps": 4, "exact_pairs": 1}
PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "flax", "optax")


def versions() -> dict:
    """The versions of JAX, its plugins and this project's libraries that are installed."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {**found, "python": platform.python_version()}


def lenet_calls(sizes: dict, train_data, test_data) -> list[dict]:
    """A LeNet epoch on one device at each number of steps per compiled call."""
    from jax_dp import train
    from jax_dp.config import RunOptions, TrainConfig

    rows = []
    for n in sizes["calls"]:
        config = TrainConfig(devices=1, batch_size=sizes["lenet_batch"], epochs=1,
                             train_examples=len(train_data.labels), test_examples=len(test_data.labels))
        run = train.train(config, train_data, test_data,
                          RunOptions(steps_per_call=n), log=lambda _: None)
        epoch_s = run["epochs"][0]["time_s"]
        rows.append({"steps_per_call": n, "epoch_s": epoch_s, "compile_s": run["compile_s"],
                     "images_per_s": len(train_data.labels) / epoch_s,
                     "test_acc": run["epochs"][0]["test_acc"]})
    return rows


def resnet18_book(sizes: dict, device) -> list[dict]:
    """ResNet-18's step at the book's 1-device configuration (batch 256, lr 0.1), with each way
    of writing the convolution gradients (jax_dp.xla_cpu.GRADS: canonical, measured faster on
    XLA:CPU, and XLA's own, the default elsewhere)."""
    import numpy as np

    from jax_dp import assembly
    from experiments.measure import timing

    rng = np.random.default_rng(0)
    batches = [{"image": rng.random((sizes["resnet_batch"], 28, 28, 1), np.float32),
                "label": rng.integers(0, 10, sizes["resnet_batch"]).astype(np.int32),
                "mask": np.ones(sizes["resnet_batch"], np.float32)} for _ in range(sizes["resnet_steps"])]
    rows = []
    for grads in ("canonical", "xla"):
        timed = timing.time_steps(assembly.make_model(sizes["resnet"], conv_grads=grads), "single",
                                     [device], batches, repeats=2, lr=0.1)
        step_s = float(np.median(timed["step_s"]))
        rows.append({"conv_grads": grads, "batch_size": sizes["resnet_batch"],
                     "steps": sizes["resnet_steps"], "step_s": step_s,
                     "images_per_s": sizes["resnet_batch"] / step_s, "compile_s": timed["compile_s"]})
    return rows


def agreement(sizes: dict, train_data, devices: int) -> list[dict]:
    """LeNet's float32 params after some steps on every backend against one device (jax.jit)."""
    from jax_dp import assembly, data
    from experiments.measure import divergence

    batches = list(data.batches(train_data, sizes["lenet_batch"]))[:sizes["compare_steps"]]
    counts = sorted({1, devices})
    result = divergence.compare(assembly.make_model("lenet"), batches,
                            [divergence.Config(b, k) for b in ("pmap", "shard_map", "jit") for k in counts],
                            lr=0.2)
    return [{"backend": r["backend"], "devices": r["devices"], "max_rel_diff": r["max_rel_diff"]}
            for r in result["runs"][1:]]


def exact_cost(sizes: dict, train_data, device) -> dict:
    """The exact mode's LeNet step against the normal one, on one device: the median of
    sizes["exact_pairs"] pairs' ratios, each pair timing the normal step, then the exact one."""
    import numpy as np

    from jax_dp import assembly, data
    from jax_dp.config import MICRO_BATCHES
    from experiments.measure.timing import time_exact

    model = assembly.make_model("lenet")
    batches = list(data.batches(train_data, sizes["lenet_batch"], pad_to=MICRO_BATCHES))
    batches = (batches * sizes["exact_steps"])[:sizes["exact_steps"]]
    normal, exact = time_exact(model, [device], batches, sizes["exact_pairs"])
    return {"normal_step_s": float(np.median(normal)), "exact_step_s": float(np.median(exact)),
            "ratio": float(np.median(np.divide(exact, normal)))}


def peak_memory(device) -> int | None:
    """The device's peak bytes in use so far (None where the platform does not say)."""
    stats = device.memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def main(args) -> None:
    """Run every part of the check, print its table, write its JSON."""
    outputs.check_writable(args.json)
    from jax_dp import data, devices as devices_lib

    sizes = QUICK if args.quick else FULL
    if args.quick:
        devices_lib.setup_devices([2])  # On CPU: two simulated devices to compare.
    import jax

    device = jax.devices()[0]
    train_data = data.load_fashion_mnist("train", limit=sizes["lenet_examples"])
    test_data = data.load_fashion_mnist("test", limit=min(10_000, sizes["lenet_examples"]))
    result = {"platform": device.platform, "device_kind": device.device_kind,
              "devices": jax.device_count(), "versions": versions(), "quick": args.quick}
    print(f"{jax.device_count()} x {device.device_kind} ({device.platform}); "
          + ", ".join(f"{k} {v}" for k, v in result["versions"].items()), flush=True)
    result["lenet_steps_per_call"] = lenet_calls(sizes, train_data, test_data)
    result["resnet18_book"] = resnet18_book(sizes, device)
    result["agreement"] = agreement(sizes, train_data, jax.device_count())
    result["exact"] = exact_cost(sizes, train_data, device)
    result["peak_bytes"] = peak_memory(device)
    print(table(result))
    outputs.write_json(args.json, result)


def table(result: dict) -> str:
    """The check as Markdown tables."""
    lines = ["| LeNet steps per call | seconds per epoch | images/s | compile s |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['steps_per_call']} | {r['epoch_s']:.2f} | {r['images_per_s']:.0f} | "
              f"{r['compile_s']:.1f} |" for r in result["lenet_steps_per_call"]]
    best = max(result["lenet_steps_per_call"], key=lambda r: r["images_per_s"])
    lines += ["", f"fastest LeNet: {best['steps_per_call']} steps per call "
              "(jax_dp.feeds.STEPS_PER_CALL for this platform)", "",
              "| ResNet-18 convolution gradients | batch | ms per step | images/s | compile s |",
              "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['conv_grads']} | {r['batch_size']} | {r['step_s'] * 1e3:.1f} | "
              f"{r['images_per_s']:.0f} | {r['compile_s']:.1f} |" for r in result["resnet18_book"]]
    fastest = min(result["resnet18_book"], key=lambda r: r["step_s"])
    lines += [f"faster: {fastest['conv_grads']} (jax_dp.xla_cpu.CANONICAL_ON lists the platforms "
              "where canonical is the default)", "",
              "| backend | devices | max rel diff against one device |", "|---|---:|---:|"]
    lines += [f"| {r['backend']} | {r['devices']} | {r['max_rel_diff']:.1e} |" for r in result["agreement"]]
    e = result["exact"]
    lines += ["", f"exact mode: {e['exact_step_s'] * 1e3:.1f} ms per LeNet step against "
              f"{e['normal_step_s'] * 1e3:.1f} ms ({e['ratio']:.2f}x)",
              f"peak device memory: {result['peak_bytes'] if result['peak_bytes'] is not None else 'n/a'} bytes"]
    return "\n".join(lines)


def parser() -> cli.OneLineParser:
    p = cli.parser(__spec__.name, __doc__)
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, two simulated CPU devices: checks the check itself")
    p.add_argument("--json", type=Path, help="write every figure here")
    return p


if __name__ == "__main__":
    process.run(main, parser)
