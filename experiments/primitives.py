"""The book's walkthrough of the data-parallel primitives, printed in a terminal.

Run: `python -m experiments.primitives` lists the (simulated) devices, copies LeNet's params
to a device, all-reduces [[1, 1]] and [[2, 2]] held on two devices (both become [[3, 3]]),
splits arange(24).reshape(6, 4) over two devices, and takes one train_batch step.
"""

from __future__ import annotations


from experiments import cli, process


def show(x) -> str:
    """An array's values and the device that holds them, as the book prints tensors."""
    import numpy as np

    (device,) = x.devices()
    return f"{np.array2string(np.asarray(x), separator=', ')} on {device}"


def main(args) -> None:
    """Print each demo in the book's order."""
    from jax_dp import devices

    devices.simulate_cpu_devices(2)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jax_dp import assembly, parallel, step as step_lib
    from jax_dp.models.lenet import init_lenet, lenet

    devs = devices.get_devices(2)
    print("devices (the book runs nvidia-smi):", jax.devices())

    params = init_lenet(jax.random.key(0))
    on_device = parallel.get_params(params, devs[:1])
    print("\nLeNet params copied to", on_device["conv1"]["w"].devices(), "shapes:",
          {name: layer["w"].shape[1:] for name, layer in on_device.items()})
    x = jnp.zeros((1, 28, 28, 1))
    grads = jax.grad(lambda p: lenet(p, x).sum())(params)
    print("gradients come back from jax.grad as a new pytree (nothing is attached to arrays):",
          {name: layer["b"].shape for name, layer in grads.items()})

    data = np.array([[1.0, 1.0], [2.0, 2.0]], np.float32)  # [[1, 1]] on device 0, [[2, 2]] on 1.
    placed = parallel.split_and_load(data, devs)
    print("\nbefore allreduce:")
    for i in range(2):
        print(" ", show(placed.addressable_data(i)[0]))
    summed = jax.pmap(parallel.allreduce, axis_name=parallel.AXIS, devices=devs)(placed)
    print("after allreduce:")
    for i in range(2):
        print(" ", show(summed.addressable_data(i)[0]))

    batch = np.arange(24).reshape(6, 4)
    shards = parallel.split_and_load(batch, devs)
    print("\ninput :", np.array2string(batch, separator=", "))
    print("load into", list(devs))
    print("output:")
    for i in range(2):
        print(" ", show(shards.addressable_data(i)[0]))

    model, tx = assembly.make_model("lenet"), optax.sgd(0.2)
    on_two = assembly.build(model, tx, "pmap", devs)
    state, metrics = on_two.place(step_lib.init_state(model, tx, jax.random.key(0)))
    rng = np.random.default_rng(0)
    global_batch = {"image": rng.random((8, 28, 28, 1), np.float32),
                    "label": rng.integers(0, 10, 8).astype(np.int32), "mask": np.ones(8, np.float32)}
    state, metrics = on_two.train(state, metrics, on_two.shard(global_batch))
    m = on_two.backend.unreplicate(metrics)
    print(f"\none training step on 2 devices: global batch {m['count']:.0f}, "
          f"mean loss {m['loss_sum'] / m['count']:.4f}, replicas identical: "
          f"{bool(np.array_equal(*np.asarray(state.params['fc2']['w'])))}")


def parser() -> cli.OneLineParser:
    """No flags but --help."""
    return cli.parser(__spec__.name, __doc__)


if __name__ == "__main__":
    process.run(main, parser)
