"""Choosing devices, and the errors for impossible choices."""

import jax
import pytest

from jax_dp import devices


def test_get_devices_takes_the_first_k():
    assert devices.get_devices(3) == tuple(jax.local_devices()[:3])


def test_asking_for_more_devices_than_exist_names_what_exists():
    with pytest.raises(ValueError, match=r"asked for 9 devices but only 8 exist \(cpu:0, .*cpu:7\)"):
        devices.get_devices(9)


@pytest.mark.parametrize("k", [0, -1])
def test_non_positive_counts_are_refused(k):
    with pytest.raises(ValueError, match="devices must be at least 1"):
        devices.get_devices(k)
    with pytest.raises(ValueError, match="devices must be at least 1"):
        devices.simulate_cpu_devices(k)


def test_simulating_more_devices_after_jax_started_is_refused():
    jax.devices()
    with pytest.raises(ValueError, match="JAX already started with 8 CPU devices, 16 needed"):
        devices.simulate_cpu_devices(16)
    devices.simulate_cpu_devices(4)  # Fewer than exist: nothing to do.


def test_setup_devices_gives_one_set_per_count():
    sets = devices.setup_devices([1, 2, 8])
    assert [len(s) for s in sets] == [1, 2, 8]


def test_a_count_that_does_not_split_over_the_processes_is_refused_before_joining():
    """Refused before start() joins the run, so every process refuses and none waits on another
    (a process left waiting when its peer refused after joining was aborted by JAX's runtime)."""
    def start():
        raise AssertionError("joined the run")

    with pytest.raises(ValueError, match="devices 3 does not split over 2 processes: use a "
                                         "multiple of 2"):
        devices.setup_devices([4, 3], start=start, processes=2)


def test_more_simulated_devices_than_xlas_collective_threads_are_refused():
    """Catches the limit moving: 256 trains (measured, docs/robustness.md), 257 waits forever in XLA."""
    devices.check_simulated(256)
    with pytest.raises(ValueError, match="devices 257 is more than the 256 CPU devices XLA can "
                                         "simulate in one process"):
        devices.check_simulated(257)

