"""How a run feeds its steps: one host batch per compiled call, or many steps per call on device.

Both feeds compute the same numbers; the run loop sees only `epoch` and the feed's call.
"""

from __future__ import annotations

from typing import Iterator

import jax
import numpy as np

from jax_dp import data, memory
from jax_dp.program import Program

# Steps per compiled call by platform. CPU, measured: 1, 10 and a whole epoch per call train
# LeNet equally fast (docs/speed.md), so checkpoints and signals keep one-step granularity.
# GPU: not yet measured (no GPU here); 16 steps hide the per-step dispatch of a short step.
STEPS_PER_CALL = {"cpu": 1, "gpu": 16}


def default_steps_per_call() -> int:
    """Steps per call for the default backend's platform (STEPS_PER_CALL: measured on CPU)."""
    return STEPS_PER_CALL.get(jax.default_backend(), 1)


class HostBatches:
    """The book's loop: the host cuts each global batch and one compiled call trains on it."""

    def __init__(self, program: Program, train_data: data.Split, batch_size: int,
                 drop_remainder: bool):
        self.program, self.train_data = program, train_data
        self.batch_size, self.drop_remainder = batch_size, drop_remainder

    def compile(self, state, metrics, start: int) -> list:
        """Compile the step ahead of time for this run's batches (all of one size: any start);
        the compiled steps."""
        size = data.padded_size(self.batch_size, self.program.pad_to)
        batch = data.zero_batch(size, self.train_data.images.shape[1:])
        return [self.program.compile("train", state, metrics, self.program.shard(batch))]

    def compiled_for(self, state, metrics, size: int):
        """The step compiled for a global batch of size rows, kept nowhere (memory.check_fits)."""
        batch = data.zero_batch(size, self.train_data.images.shape[1:])
        return self.program.lower("train", state, metrics, self.program.shard(batch)).compile()

    def epoch(self, order: np.ndarray, start: int) -> Iterator[tuple[int, dict]]:
        """The epoch's steps from step start on, as (1, placed batch) pairs."""
        for batch in data.batches(self.train_data, self.batch_size,
                                  pad_to=self.program.pad_to, order=order,
                                  start=start, drop_remainder=self.drop_remainder):
            yield 1, self.program.shard(batch)

    def __call__(self, state, metrics, batch):
        return self.program.train(state, metrics, batch)


class DeviceCalls:
    """steps_per_call steps per compiled call, under lax.scan, the training examples held on the
    devices and each batch gathered there by index (the same numbers as HostBatches)."""

    def __init__(self, program: Program, train_data: data.Split, batch_size: int,
                 drop_remainder: bool, steps_per_call: int):
        self.program, self.train_data = program, train_data
        self.batch_size, self.drop_remainder = batch_size, drop_remainder
        self.steps_per_call = steps_per_call
        self.examples = program.backend.replicate(on_device(train_data))

    def compile(self, state, metrics, start: int) -> list:
        """Compile a call for each number of steps the epoch's calls take, a resumed one's too;
        the compiled calls."""
        size = data.padded_size(self.batch_size, self.program.pad_to)
        per_epoch = data.num_batches(len(self.train_data.labels), self.batch_size,
                                     self.drop_remainder)
        lengths = {min(self.steps_per_call, per_epoch - first) for begin in {0, start}
                   for first in range(begin, per_epoch, self.steps_per_call)}
        return [self.program.compile("calls", state, metrics, self.examples,
                                     self.program.shard(zero_call(size, n))) for n in lengths]

    def compiled_for(self, state, metrics, size: int):
        """A full call compiled for global batches of size rows, kept nowhere (memory.check_fits)."""
        per_epoch = data.num_batches(len(self.train_data.labels), self.batch_size,
                                     self.drop_remainder)
        call = zero_call(size, min(self.steps_per_call, per_epoch))
        return self.program.lower("calls", state, metrics, self.examples,
                                  self.program.shard(call)).compile()

    def epoch(self, order: np.ndarray, start: int) -> Iterator[tuple[int, dict]]:
        """The epoch's steps from step start on, as (steps, placed call) pairs."""
        for call in calls(len(self.train_data.labels), self.batch_size, self.steps_per_call,
                          pad_to=self.program.pad_to, order=order, start=start,
                          drop_remainder=self.drop_remainder):
            yield call["mask"].shape[1], self.program.shard(call)

    def __call__(self, state, metrics, call):
        return self.program("calls", state, metrics, self.examples, call)


def make_feed(program: Program, train_data: data.Split, batch_size: int, drop_remainder: bool,
              steps_per_call: int) -> HostBatches | DeviceCalls:
    """HostBatches for one step per call, DeviceCalls for more."""
    if steps_per_call == 1:
        return HostBatches(program, train_data, batch_size, drop_remainder)
    return DeviceCalls(program, train_data, batch_size, drop_remainder, steps_per_call)


def compile_run(feed: HostBatches | DeviceCalls, state, metrics, start: int,
                test_image: tuple[int, ...]) -> None:
    """Compile ahead every step a run calls (feed's training calls from step start on, and
    evaluation on batches of test_image images) and refuse, in one line, steps that would not
    fit in memory (memory.check_fits)."""
    program = feed.program
    compiled = feed.compile(state, metrics, start)
    size = data.padded_size(feed.batch_size, program.pad_to)
    compiled.append(program.compile("evaluate", state, metrics,
                                    program.shard(data.zero_batch(size, test_image))))
    memory.check_fits(compiled, program.backend.local, feed.batch_size, program.pad_to,
                      lambda b: memory.step_bytes(feed.compiled_for(state, metrics, b)))


def on_device(split: data.Split) -> dict[str, np.ndarray]:
    """The split's images and labels with one all-zero example appended, which padding rows
    point at, so a gathered batch equals the one data.batches pads on the host."""
    return {"image": np.concatenate([split.images, np.zeros_like(split.images[:1])]),
            "label": np.concatenate([split.labels, np.zeros_like(split.labels[:1])])}


def calls(n: int, batch_size: int, steps_per_call: int, *, pad_to: int = 1,
          order: np.ndarray, start: int = 0, drop_remainder: bool = False) -> Iterator[dict]:
    """An epoch's steps from step `start`, steps_per_call at a time, as {"index", "mask"} of
    shape [padded batch, steps]: the examples of data.batches' batches (the batch axis leads,
    to be split over the devices like a batch's)."""
    size, total = data.padded_size(batch_size, pad_to), data.num_batches(n, batch_size,
                                                                              drop_remainder)
    for first in range(start, total, steps_per_call):
        steps = min(steps_per_call, total - first)
        index, mask = np.full((steps, size), n, np.int32), np.zeros((steps, size), np.float32)
        for i in range(steps):
            rows = order[(first + i) * batch_size:(first + i + 1) * batch_size]
            at = data.real_rows(len(rows), size, pad_to)
            index[i, at], mask[i, at] = rows, 1
        yield {"index": index.T, "mask": mask.T}


def zero_call(size: int, steps: int) -> dict[str, np.ndarray]:
    """A call of steps steps of size rows, all pointing at the first example."""
    return {"index": np.zeros((size, steps), np.int32), "mask": np.ones((size, steps), np.float32)}

