"""Fashion-MNIST through TFDS into host arrays; shuffled, padded global batches."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import sys
from pathlib import Path
from typing import Iterator, NamedTuple

import absl.logging
import jax
import numpy as np

from jax_dp import fashion_mnist, files
from jax_dp.config import DATA_SOURCES
from jax_dp.errors import ParamError, check_choice


class Split(NamedTuple):
    """One split in host memory: images float32 [N, 28, 28, 1] in [0, 1], labels int32 [N]."""
    images: np.ndarray
    labels: np.ndarray


def default_data_dir() -> Path:
    """Where prepared TFDS data lives: $TFDS_DATA_DIR, else ~/tensorflow_datasets."""
    return Path(os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets")).expanduser()


def _prepared_builder(data_dir, source_dir):
    builder = fashion_mnist.FashionMnistIdx(data_dir=str(data_dir), file_format="array_record")
    if builder.is_prepared():  # Read only: a shared, read-only data dir serves as well.
        return builder
    if Path(data_dir).exists() and not Path(data_dir).is_dir():
        raise ParamError("data_dir", f"{data_dir} is a file: pass a folder as {{}}")
    try:
        return _prepare(data_dir, source_dir)
    except OSError as e:
        raise ParamError("data_dir", f"cannot prepare Fashion-MNIST in {data_dir} ({e.strerror}): "
                         "pass a writable {} (or set TFDS_DATA_DIR)") from None
    except RuntimeError as e:  # TFDS's own report of a write that failed (a full disk).
        reason = "No space left on device" if "No space left" in str(e) else " ".join(
            str(e).split())[:120]
        raise ParamError("data_dir", f"cannot prepare Fashion-MNIST in {data_dir} ({reason}): "
                         "free some space, or pass another {} (or set TFDS_DATA_DIR)") from None


def _lock_path(data_dir) -> Path:
    """The lock a preparation holds until its files and their checksums are written."""
    return Path(data_dir) / ".fashion_mnist_idx.lock"


def _prepare(data_dir, source_dir):
    import tensorflow_datasets as tfds  # Imported here: heavy, and only needed to prepare.

    Path(data_dir).mkdir(parents=True, exist_ok=True)
    with open(_lock_path(data_dir), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # Processes started together (test workers, ranks) prepare once.
        # A new builder sees what another process prepared while this one waited.
        builder = fashion_mnist.FashionMnistIdx(data_dir=str(data_dir), file_format="array_record")
        if not builder.is_prepared():
            fashion_mnist.check_source(source_dir)
            print(f"preparing Fashion-MNIST from {source_dir} into {data_dir} (once)", file=sys.stderr)
            tfds.disable_progress_bar()
            builder.download_and_prepare(
                download_config=tfds.download.DownloadConfig(manual_dir=str(source_dir)))
            record_checksums(Path(builder.data_dir))
    return builder


# Where TFDS downloads fashion_mnist from: its own bucket, else the dataset's site.
TFDS_HOSTS = ("storage.googleapis.com", "fashion-mnist.s3-website.eu-central-1.amazonaws.com")


def _reachable(host: str, port: int = 443, timeout_s: float = 3.0) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _tfds_builder(data_dir):
    import tensorflow_datasets as tfds

    builder = tfds.builder("fashion_mnist", data_dir=str(data_dir), file_format="array_record")
    if builder.is_prepared():
        return builder
    if not any(_reachable(host) for host in TFDS_HOSTS):  # Else TFDS retries for minutes.
        raise ParamError("data", f"TFDS's fashion_mnist is not in {data_dir} and downloading it "
                         f"needs the network, which is not reachable: use {{}} debian (offline)")
    try:
        builder.download_and_prepare()
        record_checksums(Path(builder.data_dir))
    except Exception as e:  # TFDS raises many kinds; the user needs one line.
        raise ParamError("data", f"TFDS could not download fashion_mnist ({type(e).__name__}); "
                         "use {} debian offline") from None
    return builder


CHECKSUMS = "sha256.json"  # Beside the prepared files: what the preparation wrote.


def record_checksums(folder: Path) -> None:
    """Record the SHA-256 of every prepared file in folder: done by the preparing process alone,
    once its files are written, before any run reads them."""
    digests = {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
               for f in sorted(folder.glob("*.array_record*"))}
    files.write(folder / CHECKSUMS, (json.dumps(digests, indent=1) + "\n").encode())


def _recorded(record: Path) -> dict | None:
    """The checksums in record; None if there is none."""
    try:
        return json.loads(record.read_text()) if record.exists() else None
    except (ValueError, OSError) as e:
        raise ParamError("data_dir", f"{record} cannot be read ({type(e).__name__}): delete "
                         f"{record.parent} and run again to prepare it anew") from None


def check_prepared(folder: Path, split: str, lock: Path | None = None) -> None:
    """Refuse a prepared split whose files are not what its preparation recorded (each file's
    SHA-256), or that has no record. Where the record is missing, a preparation may still be
    writing it: its lock is waited for first."""
    record = folder / CHECKSUMS
    recorded = _recorded(record)
    if recorded is None and lock is not None and lock.exists():
        with open(lock) as waiting:
            fcntl.flock(waiting, fcntl.LOCK_SH)  # Until the preparer has written the record.
        recorded = _recorded(record)
    fix = f"delete {folder} and run again to prepare it anew"
    if recorded is None:
        raise ParamError("data_dir", f"{folder} holds prepared data without the checksums its "
                         f"preparation records ({CHECKSUMS}): {fix}")
    for path in sorted(folder.glob(f"*-{split}.array_record*")):
        if recorded.get(path.name) != hashlib.sha256(path.read_bytes()).hexdigest():
            raise ParamError("data_dir", f"{path} is not what was prepared (its SHA-256 is not the "
                             f"one recorded in {record}): {fix}")


def load_fashion_mnist(split: str, *, source: str = "debian", data_dir=None,
                       source_dir=fashion_mnist.DEBIAN_DIR, limit: int | None = None) -> Split:
    """Load a whole split ('train' or 'test'), preparing the TFDS data on first use."""
    check_choice("split", split, tuple(fashion_mnist.SPLITS))
    data_dir = data_dir or default_data_dir()
    # TFDS logs info and warnings, Orbax failed saves (reported in one line): none are for users.
    absl.logging.set_verbosity(absl.logging.FATAL)
    check_choice("data", source, DATA_SOURCES)
    builder = _prepared_builder(data_dir, source_dir) if source == "debian" else _tfds_builder(data_dir)
    folder = Path(builder.data_dir)
    check_prepared(folder, split, _lock_path(data_dir) if source == "debian" else None)
    if limit is not None and limit < 1:
        raise ParamError(f"{split}_examples", f"{{}} must be at least 1, got {limit}")
    try:
        records = builder.as_data_source(split=split)
        n = len(records) if limit is None else min(limit, len(records))
        examples = records.__getitems__(range(n))
    except Exception as e:  # Riegeli and TFDS raise many kinds for a file they cannot parse.
        raise ParamError("data_dir", f"cannot read the prepared {split} split in {folder} "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:100]}): delete "
                         f"{folder} and run again to prepare it anew") from None
    images = np.stack([e["image"] for e in examples]).astype(np.float32) / 255.0
    labels = np.array([e["label"] for e in examples], np.int32)
    return Split(images, labels)


def padded_size(batch_size: int, pad_to: int) -> int:
    """The smallest multiple of pad_to (the devices, or the exact mode's micro-batches) that
    holds batch_size examples."""
    return -(-batch_size // pad_to) * pad_to


def epoch_order(n: int, key: jax.Array) -> np.ndarray:
    """The order of n examples for one epoch: a permutation drawn from key."""
    return np.asarray(jax.random.permutation(key, n))


def num_batches(n: int, batch_size: int, drop_remainder: bool = False) -> int:
    """How many global batches one epoch of n examples has."""
    return n // batch_size if drop_remainder else -(-n // batch_size)


def zero_batch(size: int, image_shape: tuple[int, ...] = (28, 28, 1)) -> dict[str, np.ndarray]:
    """A batch of size all-zero images, label 0, every row real: for compiling and timing."""
    return {"image": np.zeros((size, *image_shape), np.float32), "label": np.zeros(size, np.int32),
            "mask": np.ones(size, np.float32)}


def batches(data: Split, batch_size: int, *, pad_to: int = 1, order: np.ndarray | None = None,
            start: int = 0, drop_remainder: bool = False) -> Iterator[dict[str, np.ndarray]]:
    """Global batches {image, label, mask} in the given order, from batch `start` on.

    Each batch is padded with masked rows (mask 0) to a multiple of pad_to, and the
    last, partial batch is padded the same way, so every batch has one shape and every
    example counts exactly once (drop_remainder skips the partial batch instead). A padded
    batch's real rows are spread over its pad_to groups (real_rows).
    """
    if batch_size < 1:
        raise ParamError("batch_size", f"{{}} must be at least 1, got {batch_size}")
    n = len(data.labels)
    order = np.arange(n) if order is None else order
    size = padded_size(batch_size, pad_to)
    for b in range(start, num_batches(n, batch_size, drop_remainder)):
        idx = order[b * batch_size:(b + 1) * batch_size]
        if len(idx) == size:
            yield {"image": data.images[idx], "label": data.labels[idx],
                   "mask": np.ones(size, np.float32)}
            continue
        rows = real_rows(len(idx), size, pad_to)
        image = np.zeros((size,) + data.images.shape[1:], data.images.dtype)
        label, mask = np.zeros(size, data.labels.dtype), np.zeros(size, np.float32)
        image[rows], label[rows], mask[rows] = data.images[idx], data.labels[idx], 1
        yield {"image": image, "label": label, "mask": mask}


def real_rows(real: int, size: int, groups: int) -> np.ndarray:
    """Where a padded batch of size rows keeps its `real` examples: spread over its `groups`
    equal groups (one per device, or per micro-batch in the exact mode) as evenly as they go,
    each group's real rows first, so no device is left with padding alone while another has
    two real rows more (the book splits a partial batch the same way)."""
    per_group = size // groups
    counts = real // groups + (np.arange(groups) < real % groups)
    return np.concatenate([g * per_group + np.arange(c) for g, c in enumerate(counts)])
