"""Many train steps per compiled call: the split lives on the devices, batches are gathered there."""

from __future__ import annotations

from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_dp.data import Split, num_batches, padded_size
from jax_dp.errors import ParamError

# Steps per compiled call by platform. CPU, measured: 1, 10 and a whole epoch per call train
# LeNet equally fast (README, "Speed"), so checkpoints and signals keep one-step granularity.
# GPU: not yet measured (no GPU here); 16 steps hide the per-step dispatch of a short step.
STEPS_PER_CALL = {"cpu": 1, "gpu": 16}


def default_steps_per_call() -> int:
    """Steps per call for the default backend's platform (STEPS_PER_CALL: measured on CPU)."""
    return STEPS_PER_CALL.get(jax.default_backend(), 1)


def check_steps_per_call(steps_per_call: int) -> None:
    """Refuse a number of steps per call below 1."""
    if steps_per_call < 1:
        raise ParamError("steps_per_call", f"{{}} must be at least 1, got {steps_per_call}")


def on_device(data: Split) -> dict[str, np.ndarray]:
    """The split's images and labels with one all-zero example appended, which padding rows
    point at, so a gathered batch equals the one data.batches pads on the host."""
    return {"image": np.concatenate([data.images, np.zeros_like(data.images[:1])]),
            "label": np.concatenate([data.labels, np.zeros_like(data.labels[:1])])}


def calls(n: int, batch_size: int, steps_per_call: int, *, num_devices: int = 1,
          order: np.ndarray, start: int = 0, drop_remainder: bool = False) -> Iterator[dict]:
    """An epoch's steps from step `start`, steps_per_call at a time, as {"index", "mask"} of
    shape [padded batch, steps]: the examples of data.batches' batches (the batch axis leads,
    to be split over the devices like a batch's)."""
    size, total = padded_size(batch_size, num_devices), num_batches(n, batch_size, drop_remainder)
    for first in range(start, total, steps_per_call):
        steps = min(steps_per_call, total - first)
        index, mask = np.full((steps, size), n, np.int32), np.zeros((steps, size), np.float32)
        for i in range(steps):
            rows = order[(first + i) * batch_size:(first + i + 1) * batch_size]
            index[i, :len(rows)], mask[i, :len(rows)] = rows, 1
        yield {"index": index.T, "mask": mask.T}


def scanned(step: Callable) -> Callable:
    """step(state, metrics, batch) as run(state, metrics, split, call): call's steps, in
    order, under one lax.scan, each batch gathered from split (on_device's) by index."""
    def run(state, metrics, split, call):
        def body(carry, xs):
            index, mask = xs
            batch = {"image": jnp.take(split["image"], index, axis=0),
                     "label": jnp.take(split["label"], index, axis=0), "mask": mask}
            return step(*carry, batch), None

        (state, metrics), _ = lax.scan(body, (state, metrics), (call["index"].T, call["mask"].T))
        return state, metrics
    return run
