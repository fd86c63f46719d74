"""What the tests share: random batches, SGD steps from seed 0 on any backend, checkpoints read
back, and commands run from one interpreter."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.measure import divergence
from jax_dp import assembly, step as step_lib
from jax_dp.devices import get_devices


def random_batches(n_steps, batch_size, size=28, dtype=np.float32, seed=0):
    """Batches of random size x size images with random labels, all real (mask 1)."""
    rng = np.random.default_rng(seed)
    return [{"image": rng.random((batch_size, size, size, 1)).astype(dtype),
             "label": rng.integers(0, 10, batch_size).astype(np.int32),
             "mask": np.ones(batch_size, dtype)} for _ in range(n_steps)]


def run_steps(model, backend, k, batches, *, lr, dtype=jnp.float32, **step_options):
    """SGD on k devices from seed 0's params (as dtype): placed state, host state, host metrics."""
    tx = optax.sgd(lr)
    program = assembly.build(model, tx, backend, get_devices(k), **step_options)
    b = program.backend
    # On the host, so each backend places (and may donate) its own copy. Made without x64
    # even for float64, so float32 and float64 runs share the init's compiled random ops.
    with jax.enable_x64(False):
        init = step_lib.init_state(model, tx, jax.random.key(0))
    init = jax.device_get(divergence.cast(init, dtype))
    # Metrics in dtype too: float32 sums would come back float64 and compile the step again.
    state, metrics = b.replicate(init), b.replicate(divergence.cast(step_lib.zero_metrics(), dtype))
    for batch in batches:
        state, metrics = program.train(state, metrics, b.shard(batch))
    return state, b.unreplicate(state), b.unreplicate(metrics)


def numpy_lenet(params, x):
    """The book's LeNet in float64 numpy, written apart from jax_dp: an independent reference."""
    p = {name: {k: np.asarray(v, np.float64) for k, v in layer.items()} for name, layer in params.items()}

    def conv(h, layer):  # Valid, stride 1: every kh x kw window times the HWIO kernel.
        kh, kw = layer["w"].shape[:2]
        windows = np.lib.stride_tricks.sliding_window_view(h, (kh, kw), axis=(1, 2))
        return np.einsum("bhwcij,ijco->bhwo", windows, layer["w"]) + layer["b"]

    def pool(h):  # 2x2 average, stride 2, an odd last row/column dropped.
        b, height, width, c = h.shape
        h = h[:, :height // 2 * 2, :width // 2 * 2]
        return h.reshape(b, height // 2, 2, width // 2, 2, c).mean((2, 4))

    relu = lambda h: np.maximum(h, 0)
    h = pool(relu(conv(np.asarray(x, np.float64), p["conv1"])))
    h = pool(relu(conv(h, p["conv2"]))).reshape(len(x), -1)
    h = relu(h @ p["fc1"]["w"] + p["fc1"]["b"])
    return h @ p["fc2"]["w"] + p["fc2"]["b"]


def torch_sgd_step(params, batch, lr):
    """One SGD step of jax_dp's LeNet params on batch in PyTorch (float64): the gradient of the
    mean cross-entropy, as torch autograd computes it; returns params in jax_dp's layout."""
    import torch

    from experiments.measure import torch_peer

    net = torch_peer.lenet().double()
    conv1, conv2, fc1, fc2 = net[0], net[3], net[7], net[9]
    t = lambda a: torch.tensor(np.asarray(a, np.float64))
    with torch.no_grad():
        for layer, name in ((conv1, "conv1"), (conv2, "conv2")):
            layer.weight.copy_(t(params[name]["w"]).permute(3, 2, 0, 1))  # HWIO -> OIHW
            layer.bias.copy_(t(params[name]["b"]))
        # jax_dp flattens [4, 4, 50] (HWC), PyTorch [50, 4, 4] (CHW).
        fc1.weight.copy_(t(params["fc1"]["w"]).reshape(4, 4, 50, 128).permute(3, 2, 0, 1).reshape(128, 800))
        fc1.bias.copy_(t(params["fc1"]["b"]))
        fc2.weight.copy_(t(params["fc2"]["w"]).T)
        fc2.bias.copy_(t(params["fc2"]["b"]))
    x = t(batch["image"]).permute(0, 3, 1, 2)
    loss = torch.nn.functional.cross_entropy(net(x), torch.tensor(batch["label"], dtype=torch.long))
    loss.backward()
    with torch.no_grad():
        for p in net.parameters():
            p -= lr * p.grad
    w = lambda layer: layer.weight.detach().numpy()
    return {"conv1": {"w": w(conv1).transpose(2, 3, 1, 0), "b": conv1.bias.detach().numpy()},
            "conv2": {"w": w(conv2).transpose(2, 3, 1, 0), "b": conv2.bias.detach().numpy()},
            "fc1": {"w": w(fc1).reshape(128, 50, 4, 4).transpose(2, 3, 1, 0).reshape(800, 128),
                    "b": fc1.bias.detach().numpy()},
            "fc2": {"w": w(fc2).T, "b": fc2.bias.detach().numpy()}}


def latest_checkpoint(directory):
    """(global step, arrays as saved, metadata) of the newest checkpoint in directory, read
    with Orbax alone (not through jax_dp.checkpoint, which it checks)."""
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(Path(directory).absolute(), options=ocp.CheckpointManagerOptions(
        enable_async_checkpointing=False, create=False))
    step = manager.latest_step()
    assert step is not None, f"no checkpoint in {directory}"
    restored = manager.restore(step, args=ocp.args.Composite(
        arrays=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    return step, restored["arrays"], restored["meta"]


def forked_commands(commands: tuple[tuple[str, ...], ...], env: dict) -> list:
    """Each `python -m` command (module, *flags) run as tests/forked.py runs them, all from one
    fresh interpreter: CompletedProcess-like results, in order."""
    proc = subprocess.run([sys.executable, "-m", "tests.forked", json.dumps(commands)],
                          capture_output=True, text=True, timeout=600, env=env,
                          cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr
    return [SimpleNamespace(**r) for r in json.loads(proc.stdout)]
