"""A TFDS builder for Fashion-MNIST over its IDX files, local or downloaded, verified before preparing."""

from __future__ import annotations

import gzip
import hashlib
import os
import zlib
from pathlib import Path

import numpy as np
import tensorflow_datasets as tfds

from jax_dp.config import DEBIAN_DIR, FASHION_MNIST_URL as URL  # noqa: F401  (read here too)

FIX = ("install the data with `apt-get install --reinstall dataset-fashion-mnist` "
       "or pass --idx-dir DIR holding the four IDX files")

# SHA-256 of the decompressed IDX files of the published Fashion-MNIST.
FILES = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}
SPLITS = {"train": "train", "test": "t10k"}


def _found(idx_dir: str | Path, name: str) -> Path | None:
    """The file for one IDX name in idx_dir, gzipped or plain; None if neither is there (or the
    folder may not be read: os.path.isfile says False where Path.is_file raises)."""
    return next((path for path in (Path(idx_dir) / f"{name}.gz", Path(idx_dir) / name)
                 if os.path.isfile(path)), None)


def idx_path(idx_dir: str | Path, name: str) -> Path:
    """The file for one IDX name: plain or gzipped; a clear error if neither exists."""
    if (path := _found(idx_dir, name)) is None:
        raise ValueError(f"Fashion-MNIST file {name}(.gz) is missing from {idx_dir}: {FIX}")
    return path


def has_files(idx_dir: str | Path) -> bool:
    """Whether idx_dir holds a file (plain or gzipped) for each of the four IDX names."""
    return all(_found(idx_dir, name) is not None for name in FILES)


def read_idx(path: Path, name: str, fix: str = FIX) -> bytes:
    """The decompressed bytes of IDX file name at path (gzipped or not), refused unless their
    SHA-256 is the published one."""
    try:
        raw = Path(path).read_bytes()
        data = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"{path} is truncated or corrupted ({e}): {fix}") from None
    if hashlib.sha256(data).hexdigest() != FILES[name]:
        raise ValueError(f"{path} is corrupted (its SHA-256 is not Fashion-MNIST's): {fix}")
    return data


def check_source(idx_dir: str | Path) -> None:
    """Fail fast, before TFDS starts, when any of the four files is missing or corrupted."""
    for name in FILES:
        read_idx(idx_path(idx_dir, name), name)


class FashionMnistIdx(tfds.core.GeneratorBasedBuilder):
    """Fashion-MNIST from its four IDX files: those of a folder given as TFDS's manual dir
    (Debian's dataset-fashion-mnist), else downloaded from `url` (TFDS's own fashion_mnist's
    files; TFDS checks each download against the checksums registered for its URL)."""

    VERSION = tfds.core.Version("1.0.0")
    MANUAL_DOWNLOAD_INSTRUCTIONS = f"Put the four IDX files in the manual dir, or {FIX}."

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Fashion-MNIST: 70,000 28x28 grayscale images of 10 kinds of clothing.",
            # Tensor, not Image: decoding an Image feature needs TensorFlow.
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Tensor(shape=(28, 28, 1), dtype=np.uint8),
                "label": tfds.features.ClassLabel(num_classes=10),
            }),
            supervised_keys=("image", "label"),
            homepage="https://github.com/zalandoresearch/fashion-mnist",
        )

    url: str | None = None  # Set on the instance to download instead of reading the manual dir.
    checksums: str | None = None  # A TFDS checksums file for url's files (a mirror's), if any.

    @property
    def url_infos(self):
        """The checksums TFDS checks downloads against, beside those it registers itself."""
        if self.checksums is None:
            return None
        from tensorflow_datasets.core.download.checksums import load_url_infos
        return load_url_infos(self.checksums)

    def _split_generators(self, dl_manager):
        if self.url is None:
            paths = {name: idx_path(dl_manager.manual_dir, name) for name in FILES}
            fix = FIX
        else:
            paths = dl_manager.download({name: f"{self.url}{name}.gz" for name in FILES})
            fix = f"delete {dl_manager.download_dir} and run again to download it anew"
        return {split: self._generate_examples(paths, prefix, fix)
                for split, prefix in SPLITS.items()}

    def _generate_examples(self, paths, prefix, fix):
        images, labels = f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"
        images = np.frombuffer(read_idx(paths[images], images, fix), np.uint8,
                               offset=16).reshape(-1, 28, 28, 1)
        labels = np.frombuffer(read_idx(paths[labels], labels, fix), np.uint8, offset=8)
        for i, (image, label) in enumerate(zip(images, labels)):
            yield i, {"image": image, "label": int(label)}
