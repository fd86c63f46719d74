"""The cost model of a data-parallel step: its fit, its arithmetic, its byte counts."""

import json
from pathlib import Path

import numpy as np
import pytest

from experiments.measure import hardware, cost_model
from experiments.measure.cost_model import Link
from jax_dp.errors import ParamError

HARDWARE = Path(__file__).parents[1] / "experiments" / "measure" / "hardware.json"


def test_the_fit_recovers_alpha_and_beta_from_noisy_timings():
    """Catches a swapped or mis-scaled fit: 25 us latency and 10 GB/s, 2% noise, rings of 2
    and 4 devices (2 and 6 messages, 1/2 and 3/2 of the bytes on the busiest link)."""
    rng = np.random.default_rng(0)
    true = Link(25e-6, 1e-10)
    points = [(*cost_model.busiest_link("ring", int(n), k),
               cost_model.allreduce_s(true, "ring", int(n), k))
              for k in (2, 4) for n in np.geomspace(4e3, 45e6, 8)]
    messages, sent, seconds = map(np.array, zip(*points))
    link = cost_model.fit_link(messages, sent, seconds * rng.normal(1, 0.02, len(seconds)))
    assert link.alpha == pytest.approx(25e-6, rel=0.15) and link.beta == pytest.approx(1e-10, rel=0.05)


def test_the_fits_need_two_sizes():
    with pytest.raises(ParamError, match="at least two different message sizes"):
        cost_model.fit_link([2, 2], [1e6, 1e6], [1.0, 1.1])
    with pytest.raises(ParamError, match="at least two different batch sizes"):
        cost_model.fit_line([64, 64], [1.0, 1.1])


def test_the_compute_line_is_least_squares():
    line = cost_model.fit_line([16, 32, 64], [0.011, 0.019, 0.037])
    assert line(0) == pytest.approx(0.002, abs=1e-3) and line.slope == pytest.approx(0.00054, rel=0.05)


# 1003 floats by hand: the ring cuts ceil(1003 / k) floats a chunk and passes one chunk in
# each of its 2(k - 1) rounds; the star's device 0 takes in k - 1 gradients, then sends k - 1.
BY_HAND = {2: (2, 2 * 502 * 4, 2, 2 * 4012), 3: (4, 4 * 335 * 4, 4, 4 * 4012),
           4: (6, 6 * 251 * 4, 6, 6 * 4012), 8: (14, 14 * 126 * 4, 14, 14 * 4012)}


@pytest.mark.parametrize("k", sorted(BY_HAND))
def test_ring_and_star_busiest_links_are_the_counts_by_hand(k):
    """Catches a model that charges the wrong bytes or rounds; the allreduce module's HLO
    test checks that its own ring and star send these."""
    ring_messages, ring_bytes, star_messages, star_bytes = BY_HAND[k]
    assert cost_model.busiest_link("ring", 4 * 1003, k) == (ring_messages, ring_bytes)
    assert cost_model.busiest_link("psum", 4 * 1003, k) == (ring_messages, ring_bytes)
    assert cost_model.busiest_link("star", 4 * 1003, k) == (star_messages, star_bytes)
    assert cost_model.busiest_link("ring", 4 * 1003, 1) == (0, 0)
    assert cost_model.busiest_link("star", 4 * 1003, 1) == (0, 0)


def test_a_step_by_hand():
    """4 devices, ring, 1 MB of gradients, 10 us and 1 GB/s: 6 messages of 250 KB = 60 us +
    1.5 ms; with 10 ms of compute and 1 ms fixed, 12.56 ms; overlapped, the all-reduce hides
    behind the 6.67 ms backward pass: 11 ms. Held in 3 arrays, each pays the 6 latencies."""
    comm = cost_model.allreduce_s(Link(10e-6, 1e-9), "ring", 1_000_000, 4)
    assert comm == pytest.approx(6 * 10e-6 + 6 * 250_000 * 1e-9)
    assert cost_model.allreduce_s(Link(10e-6, 1e-9), "ring", 1_000_000, 4, arrays=3) == \
        pytest.approx(18 * 10e-6 + 6 * 250_000 * 1e-9)
    assert cost_model.step_s(10e-3, comm, 1e-3) == pytest.approx(12.56e-3)
    assert cost_model.step_s(10e-3, comm, 1e-3, overlap=True) == pytest.approx(11e-3)
    assert cost_model.step_s(1e-3, comm, 1e-3, overlap=True) == \
        pytest.approx(1e-3 + 1.56e-3 - 2e-3 / 3 + 1e-3)


def test_speedups_and_the_crossover_batch_by_hand():
    """A step of 1 ms per image plus 2 ms fixed, and 10 ms of all-reduce on more than one
    device: weak scaling at batch 8 on 4 devices is 4 x 10 / 20 = 2x; strong scaling of 8
    images over 4 devices, 10 / 14 = 0.71x; half of ideal weak scaling needs 8 images."""
    step = lambda b, k: 1e-3 * b + 2e-3 + (10e-3 if k > 1 else 0)
    assert cost_model.speedup(step, 8, 4, weak=True) == pytest.approx(2.0)
    assert cost_model.speedup(step, 8, 4, weak=False) == pytest.approx(10 / 14)
    assert cost_model.speedup(step, 8, 1, weak=True) == pytest.approx(1.0)
    b = cost_model.min_batch(1e-3, 10e-3, 2e-3)
    assert b == pytest.approx(8.0)
    assert cost_model.speedup(step, b, 4, weak=True) == pytest.approx(2.0)
    assert cost_model.min_batch(1e-3, 1e-3, 2e-3) == 0.0
    with pytest.raises(ParamError, match="devices must be at least 1, got 0"):
        cost_model.speedup(step, 8, 0, weak=True)


def test_an_unknown_scheme_is_refused():
    with pytest.raises(ParamError, match="unknown scheme 'tree'"):
        cost_model.busiest_link("tree", 4, 2)


def profile_file(tmp_path, **changes):
    """A one-profile hardware JSON: 1 TFLOP/s at efficiency 0.5, 2 devices per node."""
    p = {"name": "toy", "tflops": 1.0, "efficiency": 0.5, "fixed_s": 1e-4, "devices_per_node": 2,
         "intra": {"alpha": 1e-5, "bandwidth": 1e9}, "inter": {"alpha": 1e-4, "bandwidth": 1e8}}
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"profiles": {"toy": {**p, **changes}}}))
    return path


def test_a_profile_step_by_hand(tmp_path):
    """1e9 FLOPs per image at 0.5 TFLOP/s reached: 2 ms per image. 2 devices stay in a node
    (10 us, 1 GB/s; a ring of 2 sends the whole 1 MB), 4 cross nodes (100 us, 100 MB/s): on 4,
    6 x 100 us + 1.5 MB / 100 MB/s = 15.6 ms."""
    hw = hardware.load_profiles(profile_file(tmp_path))["toy"]
    step = hw.step(1e9, 1_000_000)
    assert step(10, 1) == pytest.approx(20e-3 + 1e-4)
    assert step(10, 2) == pytest.approx(20e-3 + 2 * 1e-5 + 1e6 / 1e9 + 1e-4)
    assert step(10, 4) == pytest.approx(20e-3 + 6 * 1e-4 + 1.5e6 / 1e8 + 1e-4)


def test_the_shipped_profiles_load():
    profiles = hardware.load_profiles(HARDWARE)
    assert set(profiles) == {"v100-pcie", "v100-nvlink", "h100-nvlink", "2node-100gbe"}
    assert profiles["v100-pcie"].flops == pytest.approx(14e12 * 0.6)
    assert all(p.intra.beta < p.inter.beta or key == "v100-pcie" for key, p in profiles.items())


@pytest.mark.parametrize("write, message", [
    (None, "does not exist"),
    ('{"profiles": {', "is not valid JSON"),
    ('[1, 2]', 'has no "profiles" object'),
    ('{"profiles": {"x": {"name": "x"}}}', "profile 'x' lacks tflops, efficiency"),
])
def test_bad_profile_files_are_refused(tmp_path, write, message):
    path = tmp_path / "hw.json"
    if write is not None:
        path.write_text(write)
    with pytest.raises(ParamError, match=message):
        hardware.load_profiles(path)


@pytest.mark.parametrize("changes", [{"tflops": -1.0}, {"devices_per_node": 0},
                                     {"intra": {"alpha": 1e-5, "bandwidth": 0}},
                                     {"inter": {"alpha": "fast", "bandwidth": 1e9}}])
def test_bad_profile_values_are_refused(tmp_path, changes):
    with pytest.raises(ParamError, match="profile 'toy'"):
        hardware.load_profiles(profile_file(tmp_path, **changes))


def test_a_configs_name_gives_its_transport_and_device_count():
    assert cost_model.layout("1x4") == ("in-process", 1, 4)
    assert cost_model.layout("2x1") == ("gloo", 2, 2)
    assert cost_model.layout("2x3") == ("gloo", 2, 6)
