"""The same models in PyTorch, trained on the same batches: the peer the benchmark compares with."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


def lenet() -> nn.Module:
    """The book's LeNet (PyTorch), Normal(0, 0.01) weights, zero biases."""
    net = nn.Sequential(nn.Conv2d(1, 20, 3), nn.ReLU(), nn.AvgPool2d(2, 2), nn.Conv2d(20, 50, 5),
                        nn.ReLU(), nn.AvgPool2d(2, 2), nn.Flatten(), nn.Linear(800, 128), nn.ReLU(),
                        nn.Linear(128, 10))
    for p in net.parameters():
        nn.init.normal_(p, std=0.01) if p.dim() > 1 else nn.init.zeros_(p)
    return net


class Residual(nn.Module):
    """The book's residual block, as jax_dp.models.resnet (no bias before BatchNorm)."""

    def __init__(self, c_in, c, use_1x1conv=False, strides=1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c, 3, padding=1, stride=strides, bias=False)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.conv3 = nn.Conv2d(c_in, c, 1, stride=strides) if use_1x1conv else None
        self.bn1, self.bn2 = nn.BatchNorm2d(c), nn.BatchNorm2d(c)

    def forward(self, x):
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(y + (self.conv3(x) if self.conv3 is not None else x))


def resnet18(stage_channels=(64, 128, 256, 512), blocks_per_stage=2) -> nn.Module:
    """The small-input ResNet-18 of jax_dp.models.resnet, in PyTorch (narrower and shallower
    with its arguments, as resnet.make's)."""
    c_in = stage_channels[0]
    layers = [nn.Conv2d(1, c_in, 3, padding=1, bias=False), nn.BatchNorm2d(c_in), nn.ReLU()]
    for stage, c in enumerate(stage_channels):
        for block in range(blocks_per_stage):
            down = stage > 0 and block == 0
            layers.append(Residual(c_in, c, use_1x1conv=down, strides=2 if down else 1))
            c_in = c
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, 10))


MODELS = {"lenet": lenet, "resnet18": resnet18}


def sgd_step(model_name: str, lr: float = 0.1, fmt=torch.channels_last):
    """step(x, y): one SGD step of the model (seed 0's weights, in memory format fmt) on NCHW
    images x and labels y."""
    torch.manual_seed(0)
    net = MODELS[model_name]().to(memory_format=fmt)
    opt, loss = torch.optim.SGD(net.parameters(), lr=lr), nn.CrossEntropyLoss()

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss(net(x), y).backward()
        opt.step()
    return step


def time_steps(model_name: str, batches: list[dict], repeats: int = 3, lr: float = 0.1,
               threads: int | None = None, channels_last: bool = True) -> dict:
    """Seconds per SGD step of each repeat over batches (NHWC images as in jax_dp)."""
    if threads:
        torch.set_num_threads(threads)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    step = sgd_step(model_name, lr, fmt)
    data = [(torch.from_numpy(np.ascontiguousarray(b["image"].transpose(0, 3, 1, 2))).to(memory_format=fmt),
             torch.from_numpy(b["label"]).long()) for b in batches]
    step(*data[0])  # Warm-up: oneDNN picks its kernels on the first call.
    per_step = []
    for _ in range(repeats):
        start = time.perf_counter()
        for x, y in data:
            step(x, y)
        per_step.append((time.perf_counter() - start) / len(data))
    return {"step_s": per_step, "threads": torch.get_num_threads(), "version": torch.__version__}


def kind(aten_op: str) -> str:
    """The kind of work a PyTorch CPU op does: conv forward, conv backward (dX and dW), rest."""
    if "conv" not in aten_op:
        return "rest"
    return "conv backward" if "backward" in aten_op else "conv forward"


def step_on_zeros(model_name: str, batch_size: int) -> Callable[[], None]:
    """step(): one SGD step on batch_size zero images (channels-last), as jax_dp's profile."""
    step = sgd_step(model_name)
    x = torch.zeros(batch_size, 1, 28, 28).to(memory_format=torch.channels_last)
    y = torch.zeros(batch_size, dtype=torch.long)
    return lambda: step(x, y)


def step_profile(model_name: str, batch_size: int, steps: int = 5) -> dict:
    """Profile steps SGD steps on batch_size zero images (channels-last, after a warm-up):
    {"step_ms", "ops": [{"op", "kind", "ms"}, ...], "by_kind"}, ms being each op's self CPU
    time per step (a step's ops run one after another, each on all threads)."""
    from torch.profiler import ProfilerActivity, profile

    step = step_on_zeros(model_name, batch_size)
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        step_ms = (time.perf_counter() - start) / steps * 1e3
    rows = [{"op": e.key, "kind": kind(e.key), "ms": e.self_cpu_time_total / 1e3 / steps}
            for e in prof.key_averages() if e.self_cpu_time_total > 0]
    sums = {k: sum(r["ms"] for r in rows if r["kind"] == k) for k in ("conv forward", "conv backward")}
    return {"step_ms": step_ms, "ops": sorted(rows, key=lambda r: -r["ms"]),
            "by_kind": {**sums, "rest": step_ms - sum(sums.values())}}
