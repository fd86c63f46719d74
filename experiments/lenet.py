"""LeNet on Fashion-MNIST, from scratch, on 1 then k devices (Dive into Deep Learning, "multiple GPUs from scratch").

Run: `python -m experiments.lenet` (the book's pair: 1 device, then 2; batch 256, lr 0.2,
4 epochs). It should reach test accuracy of about 0.78 on both; see the README for times.
"""

from __future__ import annotations

from experiments import common


def main(args) -> None:
    """Train LeNet once per device count and print the book's lines."""
    from jax_dp import devices, models, train  # After flags: JAX must not start first.

    common.check_writable(args.json)
    device_sets = devices.setup_devices(args.devices)
    train_data, test_data = common.load_data(args)
    runs = []
    for devs in device_sets:
        print(f"training on {len(devs)} device(s): {', '.join(str(d) for d in devs)}")
        run = train.train(models.get_model("lenet"), train_data, test_data, devs,
                          backend=args.backend, batch_size=args.batch_size, lr=args.lr,
                          epochs=args.epochs, seed=args.seed)
        last = run["epochs"][-1]
        avg = sum(e["time_s"] for e in run["epochs"]) / len(run["epochs"])
        print(f"test acc: {last['test_acc']:.2f}, {avg:.1f} sec/epoch on {len(devs)} device(s)")
        runs.append(run)
    common.write_json(args.json, {"model": "lenet", "runs": runs})


if __name__ == "__main__":
    common.run(main, common.parser(__spec__.name, __doc__, devices="1,2", batch_size=256, lr=0.2, epochs=4))
