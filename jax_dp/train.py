"""The run loop: the book's train() over any backend, with checkpoints, signals and evaluation."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, NamedTuple

import jax
import numpy as np

from jax_dp import data as data_lib
from jax_dp import assembly, dispatch, distributed, feeds
from jax_dp.backends import Backend
from jax_dp.checkpoint import Checkpointer
from jax_dp.config import RunOptions, TrainConfig
from jax_dp.devices import get_devices
from jax_dp.errors import NamingError, ParamError
from jax_dp.events import Events, Trace
from jax_dp.program import Program
from jax_dp.progress import Progress
from jax_dp.step import TrainState, init_state


class NonFiniteError(NamingError):
    """The loss or a gradient stopped being a finite number (a diverging run, or bad data); the
    message names the parameter to lower if it diverged."""


class Interrupted(Exception):
    """SIGINT or SIGTERM stopped training between two steps; `saved` is the checkpoint's folder."""

    def __init__(self, signum: int, where: str, saved: str | None):
        super().__init__(f"interrupted at {where}; " + (f"checkpoint saved in {saved}" if saved
                                                         else "nothing saved"))
        self.signum, self.saved = signum, saved


class ProcessLost(Exception):
    """A process of a multi-process run is gone; the run ended where its newest checkpoint is."""


class Position(NamedTuple):
    """Where a run is between two steps: `step` steps done of epoch `epoch` (0-based),
    `global_step` in all; the epoch's data `order`, the run's PRNG `key`, the finished
    epochs' results in `history`, and the seconds this epoch's steps took so far."""
    epoch: int
    step: int
    global_step: int
    order: np.ndarray
    key: jax.Array
    history: tuple = ()
    epoch_s: float = 0.0

    def stepped(self, steps: int = 1) -> Position:
        """The position `steps` steps later."""
        return self._replace(step=self.step + steps, global_step=self.global_step + steps)

    def next_epoch(self, result: dict, order: np.ndarray) -> Position:
        """The position at the start of the next epoch, this one's result kept."""
        return self._replace(epoch=self.epoch + 1, step=0, order=order,
                             history=self.history + (result,), epoch_s=0.0)


def evaluate(program: Program, state: TrainState, data: data_lib.Split, batch_size: int) -> dict:
    """Sums over every example of data, each counted once, read back to the host."""
    metrics, in_flight = program.zero_metrics(), dispatch.InFlight()
    for batch in data_lib.batches(data, batch_size, pad_to=program.pad_to):
        metrics = program.evaluate(state, metrics, program.shard(batch))
        in_flight.add(metrics)
    totals = {k: float(v) for k, v in program.backend.unreplicate(metrics).items()}
    if totals["count"] != len(data.labels):
        raise RuntimeError(f"evaluation counted {totals['count']:.0f} of {len(data.labels)} "
                           "examples")
    return totals


def evaluate_accuracy(program: Program, state: TrainState, data: data_lib.Split,
                      batch_size: int = 256) -> float:
    """The book's evaluate_accuracy: correct predictions / examples, over every example."""
    totals = evaluate(program, state, data, batch_size)
    return totals["correct"] / totals["count"]


def epoch_order(config: TrainConfig, key: jax.Array, epoch: int) -> np.ndarray:
    """Epoch epoch's order of the training examples, drawn from the run's key."""
    return data_lib.epoch_order(config.train_examples,
                                jax.random.fold_in(jax.random.split(key)[1], epoch))


def train(config: TrainConfig, train_data: data_lib.Split, test_data: data_lib.Split,
          run_options: RunOptions = RunOptions(), *, log: Callable[[str], None] = print,
          on_epoch: Callable[[dict], None] = lambda summary: None,
          on_step: Callable[[Position], None] = lambda position: None) -> dict:
    """Train config's model with SGD on config.devices devices, printing the book's lines.

    Args:
      config: what the run computes (model, backend, devices, batch size, lr, ...);
        train_data and test_data must hold config.train_examples and test_examples.
      run_options: how the run is kept and watched (checkpoints, resume, watchdog, steps
        per call, progress bar). A resume refuses a checkpoint of another config (a larger
        config.epochs is allowed); a signal on an epoch's last step lets that epoch's
        evaluation finish first, then saves and raises Interrupted.
      log: where the config, compile time and per-epoch lines go.
      on_epoch: called after each epoch's evaluation with the run's summary so far (the
        return value without "state"), before that epoch's checkpoint and any stop.
      on_step: called with the position after each call, before the periodic actions
        (a signal sent from it stops the run there).

    Returns:
      {"config": the config as a dict, "steps_per_call", "compile_s", "epochs": [{"epoch", "time_s",
      "train_loss", "train_acc", "test_acc"}, ...], "state": the final TrainState on the
      host (replica 0)}.
    """
    _check_data(config, train_data, test_data)
    steps_per_call = run_options.steps_per_call or feeds.default_steps_per_call()
    platform = jax.default_backend()
    log(assembly.described(config, platform))
    parts = assembly.assemble(config, get_devices(config.devices), platform, train_data,
                              steps_per_call)
    program, feed, backend = parts.program, parts.feed, parts.program.backend
    key = jax.random.key(config.seed)
    state, metrics = program.place(init_state(parts.model, parts.tx,
                                              jax.random.split(key)[0]))
    position = Position(0, 0, 0, epoch_order(config, key, 0), key)
    ckpt = (Checkpointer(run_options.checkpoint_dir, config, backend)
            if run_options.checkpoint_dir else None)
    events = trace = None
    try:
        if run_options.resume and (
                restored := ckpt.restore(state, metrics, position, log)) is not None:
            state, metrics, position = restored
            log(f"resuming from {run_options.checkpoint_dir} at epoch {position.epoch + 1}, "
                f"step {position.step}")
        per_epoch = parts.steps_per_epoch
        start_time = time.perf_counter()
        feeds.compile_run(feed, state, metrics, position.step, test_data.images.shape[1:])
        compile_s = time.perf_counter() - start_time

        def summary() -> dict:  # Reads position when called: the history so far.
            return {"config": dataclasses.asdict(config), "steps_per_call": steps_per_call,
                    "compile_s": compile_s, "epochs": list(position.history)}

        log(f"compile {compile_s:.1f} sec on {config.devices} device(s)")

        timeout_s = run_options.step_timeout and (  # Per call.
            run_options.step_timeout * steps_per_call)
        in_flight = dispatch.InFlight(timeout_s=timeout_s)
        if run_options.logdir and distributed.is_primary():
            events = Events(run_options.logdir, dataclasses.asdict(config))
            trace = Trace(run_options.logdir, run_options.profile) if run_options.profile else None
        lr = parts.learning_rate
        progress = Progress(log, epochs=config.epochs, per_epoch=per_epoch,
                            global_batch=config.batch_size, bar=run_options.progress,
                            log_every_s=run_options.log_every,
                            report_every=run_options.scalars_every,
                            report=events and (lambda step, loss, acc, step_s: events.step(
                                step, loss, acc, float(lr(step)), step_s)))
        # A lost process is named while signals are still only recorded: the launcher's SIGTERM
        # that follows it must not end the process before the line that says why.
        with dispatch.stop_requests() as stop, _naming_lost_processes(ckpt):
            while position.epoch < config.epochs:
                # A resumed epoch's earlier steps count too.
                epoch_start = time.perf_counter() - position.epoch_s
                with progress.epoch(position.epoch, position.step):
                    for n, placed in feed.epoch(position.order, position.step):
                        if trace:
                            trace.before(position.global_step)
                        state, metrics = feed(state, metrics, placed)
                        before, position = position.global_step, position.stepped(n)
                        if trace:
                            trace.after(position.global_step, state)
                        in_flight.add(metrics,
                                      f"step {position.step} of epoch {position.epoch + 1}")
                        progress.stepped(position.epoch, position.step, n,
                                         lambda: _running(backend, metrics))
                        on_step(position)
                        if position.step < per_epoch:  # An epoch's last step is saved at its end.
                            due = _crossed(before, position.global_step,
                                           run_options.checkpoint_every)
                            _between_steps(backend, ckpt, state, metrics, position, stop, due=due,
                                           epoch_start=epoch_start)
                    in_flight.drain()
                time_s = time.perf_counter() - epoch_start
                result = _epoch_result(program, state, metrics, position, test_data,
                                       config.batch_size, time_s)
                if events:
                    events.epoch(position.global_step, result)
                log(f"epoch {result['epoch']}, time {time_s:.1f} sec, "
                    f"test acc {result['test_acc']:.2f}")
                position = position.next_epoch(
                    result, epoch_order(config, position.key, position.epoch + 1))
                metrics = program.zero_metrics()
                on_epoch(summary())
                _between_steps(backend, ckpt, state, metrics, position, stop, due=True,
                               finished=position.epoch == config.epochs)
        return {**summary(), "state": backend.unreplicate(state)}
    except Exception as e:
        _raise_if_lost(e, ckpt)
        raise
    finally:  # Also on errors and signals: finish writes and free the folder's lock.
        if ckpt:
            ckpt.close()
        if trace:
            trace.close()
        if events:
            events.close()


@contextlib.contextmanager
def _naming_lost_processes(ckpt: Checkpointer | None):
    """An error inside that says a process of the run is gone leaves as ProcessLost."""
    try:
        yield
    except Exception as e:
        _raise_if_lost(e, ckpt)
        raise


def _raise_if_lost(error: Exception, ckpt: Checkpointer | None) -> None:
    """Raise ProcessLost, naming the lost process and the newest checkpoint, if error says a
    process of the run is gone; the folder is released at once (its saves are whole, and
    Orbax's close would wait on the lost process)."""
    if isinstance(error, ProcessLost) or (lost := distributed.lost_process(error)) is None:
        return
    where = "no checkpoint was saved"
    if ckpt:
        if (newest := ckpt.newest()) is not None:
            where = (f"the newest checkpoint is step {newest} in {ckpt.directory}: resume with "
                     "--resume on the processes that remain")
        ckpt.release()
    raise ProcessLost(f"{lost[0]} of the run was lost ({lost[1]}); {where}") from None


def _check_data(config, train_data, test_data):
    """Refuse data that is not the config's."""
    for split, data in (("train", train_data), ("test", test_data)):
        if len(data.labels) != getattr(config, f"{split}_examples"):
            raise ParamError(f"{split}_examples", f"{{}} is {getattr(config, f'{split}_examples')}"
                             f" but the {split} data holds {len(data.labels)} examples")


def _crossed(before: int, after: int, every: int) -> bool:
    """Whether the global steps from before to after passed a multiple of every (0: never)."""
    return bool(every) and after // every > before // every


def _epoch_result(program: Program, state: TrainState, metrics: dict, position: Position,
                  test_data: data_lib.Split, batch_size: int, time_s: float) -> dict:
    """The finished epoch's line of the history: its training sums and the test accuracy."""
    sums = _check_finite(program.backend, metrics, position, state)
    return {"epoch": position.epoch + 1, "time_s": time_s,
            "test_acc": evaluate_accuracy(program, state, test_data, batch_size),
            "train_loss": sums["loss_sum"] / sums["count"],
            "train_acc": sums["correct"] / sums["count"]}


def _host_sums(backend: Backend, metrics: dict) -> dict:
    """The epoch's running sums on the host (waiting for its steps)."""
    return {k: v.item() for k, v in backend.unreplicate(metrics).items()}


def _running(backend: Backend, metrics: dict) -> tuple[float, float]:
    """The epoch's training loss and accuracy so far."""
    sums = _host_sums(backend, metrics)
    return sums["loss_sum"] / max(sums["count"], 1), sums["correct"] / max(sums["count"], 1)


def _between_steps(backend: Backend, ckpt: Checkpointer | None, state, metrics,
                   position: Position, stop, *, due: bool, finished: bool = False,
                   epoch_start: float | None = None) -> None:
    """The periodic actions: save when due or asked to stop, then stop if asked (unless finished).
    Mid-epoch (epoch_start given), the save keeps the seconds the epoch's steps took so far."""
    stopping = stop.signum is not None and not finished
    if not (due or stopping):
        return
    _check_finite(backend, metrics, position, state)  # Never save, nor stop quietly, past a bad step.
    if epoch_start is not None:  # After _check_finite waited for the steps.
        position = position._replace(epoch_s=time.perf_counter() - epoch_start)
    if ckpt:
        ckpt.save(state, metrics, position)
    if stopping:
        where = f"epoch {position.epoch + 1}, step {position.step}"
        raise Interrupted(stop.signum, where, str(ckpt.directory) if ckpt else None)


def _check_finite(backend: Backend, metrics: dict, position: Position,
                  state: TrainState) -> dict:
    """The epoch's sums on the host; NonFiniteError if a step went non-finite, naming it and
    what went (the loss, or the first param whose gradient did)."""
    sums = _host_sums(backend, metrics)
    if sums["first_bad"] >= 0:
        part = sums["bad_part"]
        what = ("the loss" if part == 0 else
                f"the gradient of {param_names(state.params)[part - 1]} (the loss was finite)")
        raise NonFiniteError("lr", (
            f"{what} became non-finite at epoch {position.epoch + 1}, step "
            f"{sums['first_bad'] + 1}; training stopped with the last good state "
            "(and checkpoint): if the loss was diverging, lower {}; otherwise look for "
            "a non-finite value in that step's data"))
    return sums


def param_names(params) -> list[str]:
    """Each leaf's path in params, as 'Conv_0/kernel', in the order of jax.tree.leaves."""
    return ["/".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in path)
            for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
