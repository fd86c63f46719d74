"""Nothing lost, nothing silent: uneven batches, non-finite steps, checkpoints, signals, hangs."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.measure import divergence
from jax_dp import assembly, checkpoint, data, dispatch, models, step as step_lib, train
from jax_dp.backends import make_backend
from jax_dp.config import PLACEMENT, RunOptions, TrainConfig
from jax_dp.devices import get_devices
from jax_dp.errors import ParamError

import tiny_resnet
from helpers import latest_checkpoint, run_steps

LENET = assembly.make_model("lenet")
K = 4


def padded_and_exact(n, k, seed=0, size=28):
    """The same n examples as one padded batch for k devices and as an exact batch of n."""
    rng = np.random.default_rng(seed)
    split = data.Split(rng.random((n, size, size, 1), np.float32),
                       rng.integers(0, 10, n).astype(np.int32))
    (padded,) = data.batches(split, n, pad_to=k)
    return padded, {"image": split.images, "label": split.labels, "mask": np.ones(n, np.float32)}


@pytest.mark.parametrize("n", range(K - 1, 3 * K + 2))
def test_uneven_batches_on_k_devices_equal_one_device_on_exactly_those_examples(n):
    padded, exact = padded_and_exact(n, K)
    assert padded["mask"].sum() == n and len(padded["mask"]) % K == 0
    got, m_k = run_steps(LENET, "pmap", K, [padded], lr=0.1)[1:]
    want, m_1 = run_steps(LENET, "single", 1, [exact], lr=0.1)[1:]
    assert m_k["count"] == m_1["count"] == n
    # Padded rows add exact zeros; only the order of the float32 sums differs.
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
        assert divergence.max_rel_diff(a, b) <= 1e-6


# K - 1 rows leave the last device none and the others one each; 3K + 1 leave three or four.
@pytest.mark.parametrize("n", [K - 1, 3 * K + 1])
def test_batchnorm_statistics_ignore_padded_rows(n):
    resnet = tiny_resnet.make()  # ResNet-18's code and BatchNorm, narrow and one block a stage.
    padded, exact = padded_and_exact(n, K, size=8)
    padded["image"][padded["mask"] == 0] = 1e3  # Garbage in the padding must not reach the statistics.
    # In float64: with 5 examples of 8x8 pixels, the last stage's BatchNorm normalises few
    # values, which magnifies float32 round-off past any useful bound; float64's leaves ~1e-12.
    with jax.enable_x64(True):
        _, got, _ = run_steps(resnet, "pmap", K, [divergence.cast(padded, jnp.float64)], lr=0.1,
                              dtype=jnp.float64)
        _, want, _ = run_steps(resnet, "single", 1, [divergence.cast(exact, jnp.float64)], lr=0.1,
                               dtype=jnp.float64)
    for a, b in zip(jax.tree.leaves((got.params, got.model_state)),
                    jax.tree.leaves((want.params, want.model_state))):
        assert divergence.max_rel_diff(a, b) <= 1e-9


@pytest.mark.parametrize("k,bn", [(2, "local"), (4, "local"), (2, "sync")])
def test_an_epoch_whose_last_batch_leaves_a_device_no_real_row_trains_to_its_end(k, bn):
    """The book's epoch at batch 512 ends in 96 real rows; here the last batch holds k - 1, one
    on each device but the last, none on it. Catches a 0/0 under per-device statistics: every
    step stays finite, the empty device's running statistics stay as they were, and nothing
    its padding holds changes a bit of the run. (4 devices synchronised, with a device of none:
    test_batchnorm_statistics_ignore_padded_rows[3], against one device in float64.)"""
    resnet = tiny_resnet.make(bn=bn)
    split = tiny_split(2 * 2 * k + k - 1, size=8)
    batches = list(data.batches(split, 2 * k, pad_to=k))
    assert batches[-1]["mask"].reshape(k, -1).sum(1).tolist() == [1] * (k - 1) + [0]
    garbage = {**batches[-1], "image": np.where(batches[-1]["mask"][:, None, None, None] == 1,
                                                batches[-1]["image"], np.float32(1e3))}
    before = run_steps(resnet, "pmap", k, batches[:-1], lr=0.1)[0]
    after, _, metrics = run_steps(resnet, "pmap", k, batches, lr=0.1)
    assert metrics["first_bad"] == -1 and metrics["count"] == len(split.labels)
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(after))
    chex.assert_trees_all_equal(run_steps(resnet, "pmap", k, [*batches[:-1], garbage], lr=0.1)[0],
                                after)
    if bn == "local":
        empty = lambda state: jax.tree.map(lambda a: np.asarray(a)[k - 1], state.model_state)  # noqa: E731
        chex.assert_trees_all_equal(empty(after), empty(before))


def tiny_split(n=96, seed=0, size=28):
    rng = np.random.default_rng(seed)
    return data.Split(rng.random((n, size, size, 1), np.float32),
                      rng.integers(0, 10, n).astype(np.int32))


def quiet(_):
    pass


def config_for(split, **fields):
    """A 2-device LeNet config over split (as both train and test data)."""
    n = len(split.labels)
    return TrainConfig(**{"devices": 2, "batch_size": 16, "epochs": 1, "train_examples": n,
                          "test_examples": n, **fields})


def poisoned(split, config, positions):
    """split with NaN images at these positions of config's first epoch's order."""
    order = train.epoch_order(config, jax.random.key(config.seed), 0)
    images = split.images.copy()
    images[order[list(positions)]] = np.nan
    return data.Split(images, split.labels)


def test_drop_remainder_skips_the_partial_batch():
    """Catches a tail that still trains: NaN in the 2 examples past the last full batch
    stop the kept run at its step 4, never the dropped run, which counts 48 examples."""
    split = tiny_split(50)
    config = config_for(split, drop_remainder=True)
    split = poisoned(split, config, [48, 49])
    dropped = train.train(config, split, tiny_split(50), log=quiet)
    acc, loss = dropped["epochs"][0]["train_acc"], dropped["epochs"][0]["train_loss"]
    assert np.isfinite(loss) and acc * 48 == pytest.approx(round(acc * 48), abs=1e-9)
    with pytest.raises(train.NonFiniteError, match=r"at epoch 1, step 4;"):
        train.train(dataclasses.replace(config, drop_remainder=False), split, tiny_split(50), log=quiet)


@pytest.mark.parametrize("steps_per_call", [1, 3])
@pytest.mark.parametrize("position", [0, 21, 95])
def test_a_non_finite_step_stops_training_naming_epoch_and_step(tmp_path, position, steps_per_call):
    """Catches a wrong step in the message: NaN in one example of the first epoch stops
    the run at exactly the step that holds it (batch 8: the example's position // 8 + 1)."""
    config = config_for(tiny_split(), batch_size=8, epochs=2)
    split = poisoned(tiny_split(), config, [position])
    with pytest.raises(train.NonFiniteError,
                       # A NaN pixel: relu and pooling hide it from the loss, not from conv1's
                       # gradient.
                       match=rf"^the gradient of conv1/w \(the loss was finite\) became "
                             rf"non-finite at epoch 1, step {position // 8 + 1}; "
                             r".*if the loss was diverging, lower lr; otherwise .* data$"):
        train.train(config, split, tiny_split(),
                    RunOptions(checkpoint_dir=str(tmp_path), checkpoint_every=1, steps_per_call=steps_per_call),
                    log=quiet)
    last_good = (position // 8) // steps_per_call * steps_per_call  # The last call's end before it.
    if last_good == 0:
        with pytest.raises(AssertionError, match="no checkpoint"):
            latest_checkpoint(tmp_path)
        return
    saved, arrays, _ = latest_checkpoint(tmp_path)  # The last good checkpoint is there ...
    assert saved == last_good  # ... none after it ...
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(arrays["state"]))  # ... finite.


def test_the_step_leaves_the_state_alone_once_it_is_not_finite():
    batch = padded_and_exact(8, 2)[0]
    batch["image"][0, 0, 0, 0] = np.nan
    tx = optax.sgd(0.1)
    program = assembly.build(LENET, tx, "pmap", get_devices(2))
    b = program.backend
    state0 = step_lib.init_state(LENET, tx, jax.random.key(0))
    state, metrics = program.train(b.replicate(state0), b.replicate(step_lib.zero_metrics()), b.shard(batch))
    m = b.unreplicate(metrics)
    assert m["first_bad"] == 0 and m["steps"] == 1
    assert train.param_names(state0.params)[m["bad_part"] - 1] == "conv1/w"
    for a, c in zip(jax.tree.leaves(b.unreplicate(state)), jax.tree.leaves(state0)):
        np.testing.assert_array_equal(a, c)


def test_a_non_finite_gradient_under_a_finite_loss_is_named_by_its_param():
    """Catches a message that blames the loss, or names another param, for one bad gradient."""
    params = {"conv": {"b": jnp.ones(2), "w": jnp.ones(3)}, "fc": {"w": jnp.ones(1)}}
    tx = optax.sgd(0.1)
    state = step_lib.TrainState(params, {}, tx.init(params))
    grads = jax.tree.map(jnp.ones_like, params)
    grads["conv"]["w"] = jnp.array([1.0, jnp.inf, 1.0])
    new = {"loss_sum": jnp.float32(1), "correct": jnp.float32(0), "count": jnp.float32(2)}
    _, metrics = step_lib.apply_gradients(state, step_lib.zero_metrics(), grads, new, {}, tx)
    backend = make_backend("single", get_devices(1))
    position = train.Position(0, 3, 3, np.arange(4), jax.random.key(0))
    with pytest.raises(train.NonFiniteError, match=r"^the gradient of conv/w \(the loss was "
                                                   r"finite\) became non-finite at epoch 1, step 1;"):
        train._check_finite(backend, backend.replicate(metrics), position, state)


def final_params(directory):
    """Params and global step of the latest checkpoint in directory, whatever run wrote it."""
    step, arrays, _ = latest_checkpoint(directory)
    return step, arrays["state"]


def test_same_seed_same_devices_gives_bitwise_identical_params():
    split = tiny_split()
    runs = [train.train(config_for(split, epochs=2, seed=3), split, split, log=quiet)["state"]
            for _ in range(2)]
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1])):
        np.testing.assert_array_equal(a, b)


CLI = ["--devices", "2", "--epochs", "2", "--train-examples", "2000", "--test-examples", "200",
       "--batch-size", "32", "--checkpoint-every", "20", "--no-progress"]


def start(tmp_dir, *extra):
    return subprocess.Popen([sys.executable, "-m", "experiments.lenet", *CLI, "--checkpoint-dir",
                             str(tmp_dir), "--json", str(tmp_dir / "runs.json"), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def epochs_in_json(tmp_dir):
    """The epochs the run's --json holds: it is rewritten after every epoch."""
    return json.loads((tmp_dir / "runs.json").read_text())["runs"][0]["epochs"]


def wait_for_checkpoint(directory, at_least, proc):
    """Block until a checkpoint of step >= at_least exists in directory (the run's folder)."""
    deadline = time.time() + 300
    while time.time() < deadline:
        steps = [int(p.name) for d in Path(directory).glob("bs*") for p in d.iterdir()
                 if p.name.isdigit()]
        if steps and max(steps) >= at_least:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise TimeoutError(f"no checkpoint of step {at_least} in {directory}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Final params of the CLI run, never interrupted."""
    directory = tmp_path_factory.mktemp("straight")
    proc = start(directory)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return (*final_params(next(Path(directory).glob("bs*"))), epochs_in_json(directory))


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_killed_or_stopped_run_resumes_to_bitwise_the_same_params(tmp_path, uninterrupted, how):
    proc = start(tmp_path)
    wait_for_checkpoint(tmp_path, 63, proc)  # Epoch 1 (63 steps) saved, its JSON written.
    proc.send_signal(how)
    out, err = proc.communicate(timeout=120)
    if how == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:  # Stopped cleanly: one line, a checkpoint at that step, exit code 128 + signal.
        assert proc.returncode == 128 + how, err
        assert err.count("\n") == 1 and "checkpoint saved in" in err and "--resume" in err
    first = epochs_in_json(tmp_path)
    assert [e["epoch"] for e in first] == [1]  # The finished epoch outlives the process.
    resumed = start(tmp_path, "--resume")
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    assert "resuming from" in out
    step, final = final_params(next(tmp_path.glob("bs*")))
    assert step == uninterrupted[0]
    for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(uninterrupted[1])):
        np.testing.assert_array_equal(a, b)
    both = epochs_in_json(tmp_path)
    assert both[0] == first[0]  # Carried through the checkpoint, its time included.
    untimed = [[{k: v for k, v in e.items() if k != "time_s"} for e in run]
               for run in (both, uninterrupted[2])]
    assert untimed[0] == untimed[1]


# 64 examples in batches of 16 on 2 devices: 4 steps an epoch, 8 in the run.
SPLIT = tiny_split(64)
RUN = config_for(SPLIT, epochs=2)


@pytest.fixture(scope="module")
def straight():
    """RUN's result, never interrupted, never checkpointed."""
    return train.train(RUN, SPLIT, SPLIT, log=quiet)


def untimed(epoch: dict) -> dict:
    """An epoch's results without its time."""
    return {k: v for k, v in epoch.items() if k != "time_s"}


def signal_at(step, signum=signal.SIGTERM):
    """An on_step hook that sends this process signum once the run's global step step is done."""
    return lambda position: position.global_step == step and os.kill(os.getpid(), signum)


def assert_bitwise_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("every,stop_at", [(2, 4), (4, 4), (1, 8), (0, 2), (3, 7)])
def test_a_run_stopped_at_any_step_resumes_to_bitwise_the_same_params(tmp_path, monkeypatch, straight,
                                                                      every, stop_at):
    """Catches a save that collides with the epoch-end save (every = 1, 2 and 4 all divide
    the 4 steps of an epoch; a signal on an epoch's last step, 4, or the run's, 8), and a
    resume mid-epoch (steps 2 and 7) that restarts the epoch or forgets its running sums:
    params and every epoch's results must be the uninterrupted run's."""
    saved = []
    real_save = checkpoint.Checkpointer.save
    monkeypatch.setattr(checkpoint.Checkpointer, "save", lambda self, state, metrics, position: (
        saved.append(position.global_step), real_save(self, state, metrics, position))[1])
    options = RunOptions(checkpoint_dir=str(tmp_path), checkpoint_every=every)
    summaries, stop = [], signal_at(stop_at)
    if stop_at < 8:
        with pytest.raises(train.Interrupted, match=f"checkpoint saved in {tmp_path}"):
            train.train(RUN, SPLIT, SPLIT, options, log=quiet, on_epoch=summaries.append,
                        on_step=stop)
    else:  # A signal on the run's last step comes too late to stop it.
        train.train(RUN, SPLIT, SPLIT, options, log=quiet, on_epoch=summaries.append, on_step=stop)
    # Each finished epoch is reported, the one a stop ends included.
    assert [[e["epoch"] for e in s["epochs"]] for s in summaries] == [[1], [1, 2]][:stop_at // 4]
    due = [s for s in range(1, stop_at + 1) if (every and s % every == 0) or s % 4 == 0]
    assert saved == sorted(set(due + [stop_at]))  # Each global step saved once at most.
    step, _, meta = latest_checkpoint(tmp_path)
    assert step == stop_at and (meta["epoch"], meta["step"]) == divmod(stop_at, 4)
    assert len(meta["history"]) == stop_at // 4  # At an epoch's end, its evaluation is saved.
    monkeypatch.undo()
    resumed = train.train(RUN, SPLIT, SPLIT, dataclasses.replace(options, resume=True), log=quiet,
                          on_epoch=summaries.append)
    assert_bitwise_equal(resumed["state"], straight["state"])
    assert [untimed(e) for e in resumed["epochs"]] == [untimed(e) for e in straight["epochs"]]
    assert summaries[-1]["epochs"] == resumed["epochs"]


def test_a_finished_run_resumed_with_more_epochs_equals_the_longer_run(tmp_path, straight):
    train.train(dataclasses.replace(RUN, epochs=1), SPLIT, SPLIT,
                RunOptions(checkpoint_dir=str(tmp_path)), log=quiet)
    longer = train.train(RUN, SPLIT, SPLIT, RunOptions(checkpoint_dir=str(tmp_path), resume=True),
                         log=quiet)
    assert_bitwise_equal(longer["state"], straight["state"])


@pytest.fixture(scope="module")
def finished_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    train.train(RUN, SPLIT, SPLIT, RunOptions(checkpoint_dir=str(directory)), log=quiet)
    return directory


# A value unlike RUN's for every field of TrainConfig and every option of its model (another
# model: a perceptron, whose params are made without running a network op by op).
OTHER_VALUES = {"model": "tests.tiny_mlp", "backend": "shard_map", "allreduce": "ring", "devices": 4,
                "batch_size": 32, "lr": 0.1, "warmup_epochs": 1.0, "epochs": 1, "seed": 1, "exact": True,
                "compute_dtype": "bfloat16", "drop_remainder": True, "train_examples": 32, "test_examples": 32,
                "conv": "xla", "activation": "softplus", "conv_grads": "xla"}


def test_every_field_and_model_option_has_a_value_to_resume_with():
    assert set(OTHER_VALUES) == {f.name for f in dataclasses.fields(TrainConfig)} - {"options"} \
        | {option.name for option in models.declared(models.model_module(RUN.model))}


# Written out, not read from the code: only these place the run (and a larger epochs).
RESUMABLE = ("devices", "backend", "allreduce")


def test_the_fields_a_resume_may_change_are_the_placement_alone():
    assert set(PLACEMENT) == set(RESUMABLE)


@pytest.mark.parametrize("field", sorted(set(OTHER_VALUES) - set(RESUMABLE)))
def test_resuming_with_any_other_field_is_refused_naming_it(finished_checkpoint, field):
    """Catches a field or model option exempted from the check: every one is refused by name."""
    value = OTHER_VALUES[field]
    if field in ("conv", "activation", "conv_grads"):
        config = dataclasses.replace(RUN, options={field: value})
    else:  # Another model comes with its own options.
        config = dataclasses.replace(RUN, **{field: value}, **({"options": {}} if field == "model" else {}))
    train_split = tiny_split(32) if field == "train_examples" else SPLIT
    test = data.Split(SPLIT.images[:32], SPLIT.labels[:32]) if field == "test_examples" else SPLIT
    with pytest.raises(ParamError) as e:
        train.train(config, train_split, test,
                    RunOptions(resume=True, checkpoint_dir=str(finished_checkpoint)), log=quiet)
    old = models.model_options(RUN.model)[field] if field in ("conv", "activation", "conv_grads") else \
        getattr(RUN, field)
    assert f"was written with {field} {old!r}, this run has {field} {value!r}" in str(e.value)
    assert e.value.params == (field, field, "checkpoint_dir")


@pytest.mark.parametrize("field", RESUMABLE)
def test_a_resume_may_change_where_the_run_is_placed(finished_checkpoint, field):
    """Devices, backend and all-reduce place the run: the finished run is found, not refused."""
    config = dataclasses.replace(RUN, **{field: OTHER_VALUES[field]})
    resumed = train.train(config, SPLIT, SPLIT, RunOptions(
        resume=True, checkpoint_dir=str(finished_checkpoint)), log=quiet)
    assert len(resumed["epochs"]) == RUN.epochs


def test_data_that_is_not_the_configs_is_refused():
    with pytest.raises(ParamError, match="train_examples is 64 but the train data holds 50"):
        train.train(RUN, tiny_split(50), SPLIT, log=quiet)


def test_a_wedged_step_ends_the_run_with_one_line_and_exit_code_3(tmp_path):
    script = tmp_path / "wedged.py"
    script.write_text(
        "import time, jax\n"
        "from jax_dp import dispatch\n"
        "dispatch.jax.block_until_ready = lambda tree: time.sleep(3600)  # A collective that never returns.\n"
        "queue = dispatch.InFlight(timeout_s=1)\n"
        "for i in range(5):\n"
        "    queue.add(jax.numpy.ones(3), f'step {i + 1} of epoch 1')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == dispatch.WEDGED_EXIT_CODE
    assert proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("error: step 1 of epoch 1 did not finish within 1 s")


def test_a_run_suspended_longer_than_the_timeout_is_not_taken_for_wedged(tmp_path):
    """Ctrl-Z (SIGSTOP) for 7 s in a step with a 6 s timeout, then SIGCONT: the run goes on.
    The step waits for the parent, then 0.5 s more, so the watchdog looks while it is
    unfinished."""
    script = tmp_path / "suspended.py"
    script.write_text(
        "import sys, time, jax\n"
        "from jax_dp import dispatch\n"
        "def step(tree):\n"
        "    print('in step', flush=True)\n"
        "    sys.stdin.readline()\n"
        "    time.sleep(0.5)\n"
        "dispatch.jax.block_until_ready = step\n"
        "queue = dispatch.InFlight(timeout_s=6)\n"
        "queue.add(jax.numpy.ones(3), 'step 1 of epoch 1')\n"
        "queue.drain()\n"
        "print('finished', flush=True)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "in step\n"
    proc.send_signal(signal.SIGSTOP)
    time.sleep(7)
    proc.stdin.write("go\n")  # Read only once the process continues.
    proc.stdin.flush()
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out == "finished\n"


class StepClock:
    """train's time.perf_counter, moved on only by the test (the clock JAX reads is left alone)."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now


def test_a_resumed_epoch_counts_the_seconds_its_steps_took_before_the_stop(tmp_path, monkeypatch):
    """By a clock that moves 1 s per step of the first run and stands still in the resumed one:
    the resumed epoch 1 counts the 2 s of the steps before the stop, epoch 2 starts from 0."""
    clock, stop = StepClock(), signal_at(2)  # Stops after epoch 1's step 2 of 4.
    monkeypatch.setattr(train, "time", clock)

    def step(position):
        clock.now += 1.0
        stop(position)
    with pytest.raises(train.Interrupted):
        train.train(RUN, SPLIT, SPLIT,
                    RunOptions(checkpoint_dir=str(tmp_path)), log=quiet, on_step=step)
    assert latest_checkpoint(tmp_path)[2]["epoch_s"] == 2.0
    times = [e["time_s"] for e in train.train(RUN, SPLIT, SPLIT,
                                              RunOptions(checkpoint_dir=str(tmp_path), resume=True),
                                              log=quiet)["epochs"]]
    assert times == [2.0, 0.0]
