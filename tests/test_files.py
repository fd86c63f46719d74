"""Whole-file outputs touch only the file named: symbolic links are followed, devices and FIFOs
are written through and kept, folders refused; the checkpoint lock never follows a link."""

import os
import stat

import pytest

from jax_dp import files
from jax_dp import checkpoint
from jax_dp.errors import ParamError


def test_a_regular_file_is_replaced_whole_and_keeps_its_mode(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    path.chmod(0o640)
    files.write(path, b"new")
    assert path.read_bytes() == b"new" and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]  # No part file left.


def test_a_symlink_is_followed_to_its_target_and_stays_a_link(tmp_path):
    target, link = tmp_path / "real.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target)
    files.check(link)
    files.write(link, b"new")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_bytes() == b"new"


def test_a_fifo_is_written_through_to_its_reader_and_kept(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    # A reader before the write: without one, write refuses the FIFO at once.
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    files.check(fifo)
    files.write(fifo, b"payload")  # Fits the pipe's buffer; the writer has closed after it.
    assert os.read(reader, 100) == b"payload" and os.read(reader, 100) == b""  # Then EOF.
    os.close(reader)
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def device(tmp_path, name, minor):
    """A character device of its own in tmp_path (1, minor: 3 is null, 7 is full), so that a
    broken write can replace only this node, never the machine's /dev."""
    path = tmp_path / name
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, minor))
    except PermissionError:
        pytest.skip("making a device node needs root (CI runs as root)")
    return path


def test_a_device_is_written_through_and_never_replaced(tmp_path):
    null = device(tmp_path, "null", 3)
    files.check(null)
    files.write(null, b"x" * 100)
    assert stat.S_ISCHR(null.stat().st_mode) and null.stat().st_rdev == os.makedev(1, 3)


def test_a_full_device_is_one_line_and_stays_a_device(tmp_path):
    full = device(tmp_path, "full", 7)
    with pytest.raises(ValueError, match=rf"^cannot write {full} \(No space left on device\): "):
        files.write(full, b"x")
    assert stat.S_ISCHR(full.stat().st_mode)


def test_a_folder_or_a_missing_folder_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="it is a folder"):
        files.check(tmp_path)
    with pytest.raises(ValueError, match="no folder"):
        files.check(tmp_path / "missing" / "out.json")
    assert list(tmp_path.iterdir()) == []


def test_a_planted_lock_symlink_is_refused_and_its_target_left_byte_for_byte(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(victim)
    with pytest.raises(ParamError, match=r"\.lock is a symbolic link, not a lock of this project"):
        checkpoint._lock(run)
    assert victim.read_bytes() == b"precious\n"


@pytest.mark.parametrize("plant", ["fifo", "hard link"])
def test_a_lock_that_is_no_regular_file_of_its_own_is_refused_and_left(tmp_path, plant):
    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    if plant == "fifo":
        os.mkfifo(run / ".lock")
    else:
        os.link(victim, run / ".lock")
    with pytest.raises(ParamError, match=r"\.lock is (not a regular file|a hard link)"):
        checkpoint._lock(run)
    assert victim.read_bytes() == b"precious\n"
    assert stat.S_ISFIFO((run / ".lock").stat().st_mode) == (plant == "fifo")


def test_the_lock_holds_the_pid_of_its_run(tmp_path):
    lock = checkpoint._lock(tmp_path)
    try:
        assert (tmp_path / ".lock").read_text() == f"{os.getpid()}\n"
    finally:
        lock.close()
