"""A TFDS builder for Fashion-MNIST over local IDX files, verified before preparing."""

from __future__ import annotations

import gzip
import hashlib
import zlib
from pathlib import Path

import numpy as np
import tensorflow_datasets as tfds

DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
FIX = ("install the data with `apt-get install --reinstall dataset-fashion-mnist` "
       "or pass --data-source DIR holding the four IDX files")

# SHA-256 of the decompressed IDX files of the published Fashion-MNIST.
FILES = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}
SPLITS = {"train": "train", "test": "t10k"}


def idx_path(source_dir: str | Path, name: str) -> Path:
    """The file for one IDX name: plain or gzipped; a clear error if neither exists."""
    for path in (Path(source_dir) / f"{name}.gz", Path(source_dir) / name):
        if path.is_file():
            return path
    raise ValueError(f"Fashion-MNIST file {name}(.gz) is missing from {source_dir}: {FIX}")


def read_idx(source_dir: str | Path, name: str) -> bytes:
    """The decompressed bytes of one IDX file, refused unless their SHA-256 is the published one."""
    path = idx_path(source_dir, name)
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"{path} is truncated or corrupted ({e}): {FIX}") from None
    if hashlib.sha256(data).hexdigest() != FILES[name]:
        raise ValueError(f"{path} is corrupted (its SHA-256 is not Fashion-MNIST's): {FIX}")
    return data


def check_source(source_dir: str | Path) -> None:
    """Fail fast, before TFDS starts, when any of the four files is missing or corrupted."""
    for name in FILES:
        read_idx(source_dir, name)


class FashionMnistIdx(tfds.core.GeneratorBasedBuilder):
    """Fashion-MNIST read from a manual dir of IDX files (Debian's dataset-fashion-mnist)."""

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

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(dl_manager.manual_dir, prefix)
                for split, prefix in SPLITS.items()}

    def _generate_examples(self, source_dir, prefix):
        images = np.frombuffer(read_idx(source_dir, f"{prefix}-images-idx3-ubyte"), np.uint8,
                               offset=16).reshape(-1, 28, 28, 1)
        labels = np.frombuffer(read_idx(source_dir, f"{prefix}-labels-idx1-ubyte"), np.uint8,
                               offset=8)
        for i, (image, label) in enumerate(zip(images, labels)):
            yield i, {"image": image, "label": int(label)}
