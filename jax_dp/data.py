"""Fashion-MNIST through TFDS into host arrays; shuffled, padded global batches."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import urllib.parse
from pathlib import Path
from typing import Iterator, NamedTuple

import jax
import numpy as np

from jax_dp import fashion_mnist, files
from jax_dp.config import DATA_SOURCES
from jax_dp.errors import ParamError, check_choice

# Said once, at WARNING so that it shows without any logging set up: preparing takes a while.
logger = logging.getLogger(__name__)


class Split(NamedTuple):
    """One split in host memory: images float32 [N, 28, 28, 1] in [0, 1], labels int32 [N]."""
    images: np.ndarray
    labels: np.ndarray


def default_data_dir() -> Path:
    """Where prepared TFDS data lives: $TFDS_DATA_DIR, else ~/tensorflow_datasets."""
    return Path(os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets")).expanduser()


def _prepared_builder(tfds_dir, source, idx_dir, url, checksums):
    """The prepared builder in tfds_dir, prepared first from where source says if need be."""
    builder = fashion_mnist.FashionMnistIdx(data_dir=str(tfds_dir), file_format="array_record")
    if builder.is_prepared():  # Read only: a shared, read-only data dir serves as well.
        return builder
    if Path(tfds_dir).exists() and not Path(tfds_dir).is_dir():
        raise ParamError("tfds_dir", f"{tfds_dir} is a file: pass a folder as {{}}")
    idx_dir, url = _origin(source, tfds_dir, idx_dir, url)
    try:
        return _prepare(tfds_dir, idx_dir, url, checksums)
    except OSError as e:
        raise ParamError("tfds_dir", f"cannot prepare Fashion-MNIST in {tfds_dir} ({e.strerror}): "
                         "pass a writable {} (or set TFDS_DATA_DIR)") from None
    except RuntimeError as e:  # TFDS's own report of a write that failed (a full disk).
        reason = "No space left on device" if "No space left" in str(e) else " ".join(
            str(e).split())[:120]
        raise ParamError("tfds_dir", f"cannot prepare Fashion-MNIST in {tfds_dir} ({reason}): "
                         "free some space, or pass another {} (or set TFDS_DATA_DIR)") from None


def _origin(source, tfds_dir, idx_dir, url) -> tuple[str | None, str | None]:
    """(idx_dir, None) to prepare from the IDX files there, or (None, url) to download them:
    for 'auto', idx_dir where it holds them (Debian's, offline), else url where it answers."""
    if source == "debian" or (source == "auto" and fashion_mnist.has_files(idx_dir)):
        return idx_dir, None
    if _reachable(url):
        return None, url
    if source == "download":
        raise ParamError("data", f"Fashion-MNIST is not prepared in {tfds_dir} and its download "
                         f"({url}) is not reachable: connect to the network, or use {{}} debian "
                         "(Debian's dataset-fashion-mnist, offline)")
    raise ParamError(("idx_dir", "data"), (
        f"Fashion-MNIST is not prepared in {tfds_dir}, {idx_dir} does not hold its four IDX "
        f"files, and TFDS's download of them ({url}) is not reachable: install Debian's "
        "dataset-fashion-mnist (or pass {} DIR holding the files), or connect to the network "
        "for {} download"))


def managed_paths(tfds_dir) -> list[Path]:
    """What a preparation in tfds_dir writes and guards: the prepared dataset and its lock."""
    return [Path(tfds_dir) / "fashion_mnist_idx", _lock_path(tfds_dir)]


def _lock_path(tfds_dir) -> Path:
    """The lock a preparation holds until its files and their checksums are written."""
    return Path(tfds_dir) / ".fashion_mnist_idx.lock"


def _prepare(tfds_dir, idx_dir, url, checksums=None):
    """Prepare Fashion-MNIST in tfds_dir from the IDX files in idx_dir, or downloaded from url
    (each download checked by TFDS against its registered checksums and those in checksums)."""
    import tensorflow_datasets as tfds  # Imported here: heavy, and only needed to prepare.

    Path(tfds_dir).mkdir(parents=True, exist_ok=True)
    with open(_lock_path(tfds_dir), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # Processes started together (test workers, ranks) prepare once.
        # A new builder sees what another process prepared while this one waited.
        builder = fashion_mnist.FashionMnistIdx(data_dir=str(tfds_dir), file_format="array_record")
        if builder.is_prepared():
            return builder
        tfds.disable_progress_bar()
        if url is None:
            fashion_mnist.check_source(idx_dir)
            logger.warning(f"preparing Fashion-MNIST from {idx_dir} into {tfds_dir} (once)")
            builder.download_and_prepare(
                download_config=tfds.download.DownloadConfig(manual_dir=str(idx_dir)))
        else:
            logger.warning(f"downloading Fashion-MNIST from {url} and preparing it into "
                           f"{tfds_dir} (once)")
            builder.url, builder.checksums = url, checksums and str(checksums)
            _download_and_prepare(builder, Path(tfds_dir) / "downloads" / builder.name)
        record_checksums(Path(builder.data_dir))
    return builder


def _download_and_prepare(builder, download_dir: Path) -> None:
    """builder prepared from the four files downloaded from builder.url into download_dir,
    which is deleted if any download fails or is damaged (TFDS would otherwise reuse it)."""
    from tensorflow_datasets.core.download.download_manager import NonMatchingChecksumError

    url = builder.url
    fix = "nothing was prepared, and the download was deleted: run again to download it anew"
    try:
        builder.download_and_prepare(download_dir=str(download_dir))
    except NonMatchingChecksumError as e:
        shutil.rmtree(download_dir, ignore_errors=True)
        name = match[1] if (match := re.search(r"Artifact (\S+), ", str(e))) else url
        raise ParamError("data", f"{name} does not match the checksum TFDS registers for it "
                         f"(a damaged or altered download): {fix}, or use {{}} debian") from None
    except ValueError as e:  # read_idx: the decompressed bytes are not Fashion-MNIST's.
        shutil.rmtree(download_dir, ignore_errors=True)
        raise ParamError("data", f"{str(e).split(': ')[0]}: {fix}, or use {{}} debian") from None
    except Exception as e:  # A connection lost or refused mid-download, in TFDS's many kinds.
        if isinstance(e, OSError) and e.errno is not None:
            raise  # The data dir's own failure: _prepared_builder names it.
        shutil.rmtree(download_dir, ignore_errors=True)
        reason = " ".join(str(e).split())[:120]
        raise ParamError("data", f"downloading Fashion-MNIST from {url} failed ({type(e).__name__}"
                         f": {reason}): {fix}, or use {{}} debian") from None


def _reachable(url: str, timeout_s: float = 3.0) -> bool:
    """Whether url's host accepts a connection (else TFDS retries for minutes)."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
        return True
    except (OSError, ValueError):
        return False


CHECKSUMS = "sha256.json"  # Beside the prepared files: what the preparation wrote.


def record_checksums(folder: Path) -> None:
    """Record the SHA-256 of every prepared file in folder, the dataset's info and features
    included: done by the preparing process alone, once its files are written, before any run
    reads them."""
    digests = {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
               for f in sorted(folder.iterdir()) if f.is_file() and f.name != CHECKSUMS}
    files.write(folder / CHECKSUMS, (json.dumps(digests, indent=1) + "\n").encode())


def _recorded(record: Path) -> dict | None:
    """The checksums in record; None if there is none."""
    try:
        return json.loads(record.read_text()) if record.exists() else None
    except (ValueError, OSError) as e:
        raise ParamError("tfds_dir", f"{record} cannot be read ({type(e).__name__}): delete "
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
        raise ParamError("tfds_dir", f"{folder} holds prepared data without the checksums its "
                         f"preparation records ({CHECKSUMS}): {fix}")
    # This split's records and every file that says what the records are (dataset_info.json
    # names each split's files and sizes): the other split's records are not read.
    read = [p for p in sorted(folder.iterdir()) if p.is_file() and p.name != CHECKSUMS
            and (".array_record" not in p.name or f"-{split}.array_record" in p.name)]
    missing = [name for name in recorded if not (folder / name).exists()]
    for path in read + [folder / name for name in missing]:
        if not path.exists() or recorded.get(path.name) != hashlib.sha256(path.read_bytes()).hexdigest():
            raise ParamError("tfds_dir", f"{path} is not what was prepared (its SHA-256 is not the "
                             f"one recorded in {record}): {fix}")


def load_fashion_mnist(split: str, *, source: str = "auto", tfds_dir=None,
                       idx_dir=fashion_mnist.DEBIAN_DIR, url: str = fashion_mnist.URL,
                       checksums=None, limit: int | None = None) -> Split:
    """Load a whole split ('train' or 'test'), preparing it in tfds_dir (TFDS's data dir) on
    first use: from the IDX files in idx_dir (source 'debian'), downloaded from url
    ('download'), or the first of these that is there ('auto'). Every source prepares the
    same verified bytes. checksums: a TFDS checksums file for a mirror's url."""
    check_choice("split", split, tuple(fashion_mnist.SPLITS))
    tfds_dir = tfds_dir or default_data_dir()
    check_choice("data", source, DATA_SOURCES)
    builder = _prepared_builder(tfds_dir, source, idx_dir, url, checksums)
    folder = Path(builder.data_dir)
    check_prepared(folder, split, _lock_path(tfds_dir))
    if limit is not None and limit < 1:
        raise ParamError(f"{split}_examples", f"{{}} must be at least 1, got {limit}")
    try:
        records = builder.as_data_source(split=split)
        n = len(records) if limit is None else min(limit, len(records))
        examples = records.__getitems__(range(n))
    except Exception as e:  # Riegeli and TFDS raise many kinds for a file they cannot parse.
        raise ParamError("tfds_dir", f"cannot read the prepared {split} split in {folder} "
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
