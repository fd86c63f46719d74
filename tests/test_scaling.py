"""The cost model of a data-parallel step: its fit, its arithmetic, its byte counts."""

import numpy as np
import pytest

from jax_dp import allreduce, scaling
from jax_dp.errors import ParamError
from jax_dp.scaling import Link


def test_the_fit_recovers_alpha_and_beta_from_noisy_timings():
    """Catches a swapped or mis-scaled fit: 25 us latency and 10 GB/s, with 2% noise."""
    rng = np.random.default_rng(0)
    sizes = np.geomspace(4e3, 45e6, 12)
    seconds = (25e-6 + sizes / 10e9) * rng.normal(1, 0.02, len(sizes))
    link = scaling.fit_link(sizes, seconds)
    assert link.alpha == pytest.approx(25e-6, rel=0.15) and link.beta == pytest.approx(1e-10, rel=0.05)


def test_the_fit_needs_two_message_sizes():
    with pytest.raises(ParamError, match="at least two different message sizes"):
        scaling.fit_link([1e6, 1e6], [1.0, 1.1])


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_ring_and_star_byte_counts_are_the_allreduce_modules(k):
    """The model charges the bytes jax_dp.allreduce's own ring and star send (its HLO test
    measures those): the ring's per device, the star's device 0 twice (in, then out)."""
    n_bytes = 4 * 1003
    assert scaling.busiest_link("ring", n_bytes, k) == (2 * (k - 1), allreduce.bytes_sent("ring", 1003, k)[0])
    assert scaling.busiest_link("psum", n_bytes, k) == scaling.busiest_link("ring", n_bytes, k)
    assert scaling.busiest_link("star", n_bytes, k) == (2 * (k - 1), 2 * (k - 1) * n_bytes)
    assert scaling.busiest_link("ring", n_bytes, 1) == (0, 0)


def test_a_step_by_hand():
    """4 devices, ring, 1 MB of gradients, 10 us and 1 GB/s: 6 messages of 250 KB = 60 us +
    1.5 ms; with 10 ms of compute and 1 ms fixed, 12.56 ms; overlapped, the all-reduce hides
    behind the 6.67 ms backward pass: 11 ms."""
    comm = scaling.allreduce_s(Link(10e-6, 1e-9), "ring", 1_000_000, 4)
    assert comm == pytest.approx(6 * 10e-6 + 6 * 250_000 * 1e-9)
    assert scaling.step_s(10e-3, comm, 1e-3) == pytest.approx(12.56e-3)
    assert scaling.step_s(10e-3, comm, 1e-3, overlap=True) == pytest.approx(11e-3)
    assert scaling.step_s(1e-3, comm, 1e-3, overlap=True) == pytest.approx(1e-3 + 1.56e-3 - 2e-3 / 3 + 1e-3)


def test_an_unknown_scheme_is_refused():
    with pytest.raises(ParamError, match="unknown scheme 'tree'"):
        scaling.busiest_link("tree", 4, 2)
