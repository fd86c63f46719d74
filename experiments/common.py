"""What every experiment shares: flags, device set-up, data, clean one-line errors."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def device_counts(text: str) -> list[int]:
    """Parse '1,2,4' into [1, 2, 4]."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts like 1,2,4, got {text!r}") from None
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"device counts must be at least 1, got {text!r}")
    return counts


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parser(module: str, doc: str, *, devices: str, batch_size: int, lr: float,
           epochs: int) -> argparse.ArgumentParser:
    """The flags every training experiment takes, with its own defaults."""
    p = OneLineParser(prog=f"python -m {module}", description=doc.splitlines()[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--devices", type=device_counts, default=device_counts(devices),
                   help="device counts to train on, one run each (CPU: simulated devices)")
    p.add_argument("--batch-size", type=int, default=batch_size,
                   help="global batch size, split over the devices")
    p.add_argument("--lr", type=float, default=lr, help="SGD learning rate")
    p.add_argument("--epochs", type=int, default=epochs, help="passes over the training set")
    p.add_argument("--seed", type=int, default=0, help="seed of params and data order")
    p.add_argument("--backend", default="pmap", choices=["pmap", "single"],
                   help="how steps run over the devices ('single' needs --devices 1)")
    p.add_argument("--train-examples", type=int,
                   help="train on the first N training examples only (default: all 60,000)")
    p.add_argument("--test-examples", type=int,
                   help="evaluate on the first N test examples only (default: all 10,000)")
    p.add_argument("--json", type=Path, help="write the per-epoch history here")
    p.add_argument("--data", default="debian", choices=["debian", "tfds"],
                   help="Fashion-MNIST from Debian's IDX files (offline) or TFDS's download")
    p.add_argument("--data-source", default="/usr/share/datasets/fashion-mnist",
                   help="folder of the four IDX files, for --data debian")
    p.add_argument("--data-dir", help="TFDS data dir (default: $TFDS_DATA_DIR or ~/tensorflow_datasets)")
    return p


def load_data(args):
    """The train and test splits the flags ask for."""
    from jax_dp import data

    load = dict(source=args.data, data_dir=args.data_dir, source_dir=args.data_source)
    return (data.load_fashion_mnist("train", limit=args.train_examples, **load),
            data.load_fashion_mnist("test", limit=args.test_examples, **load))


def check_writable(path: Path | None) -> None:
    """Fail before training, not after, when an output file cannot be written."""
    if path is None:
        return
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise ValueError(f"cannot write {path} ({e.strerror}): pass a writable path") from None


def write_json(path: Path | None, payload: dict) -> None:
    """Write payload as indented JSON when a path was given."""
    if path is not None:
        path.write_text(json.dumps(payload, indent=2) + "\n")


def with_tcmalloc() -> None:
    """Re-run this process with tcmalloc preloaded when it is installed: XLA:CPU runs ~2x faster."""
    if os.path.exists(TCMALLOC) and "tcmalloc" not in os.environ.get("LD_PRELOAD", "") \
            and not os.environ.get("JAX_DP_NO_TCMALLOC"):
        env = dict(os.environ, LD_PRELOAD=TCMALLOC)
        os.execve(sys.executable, [sys.executable] + sys.orig_argv[1:], env)


def run(main: Callable[[argparse.Namespace], None], p: argparse.ArgumentParser) -> None:
    """Parse flags and run main; a ValueError becomes one line on stderr and exit code 2."""
    args = p.parse_args()
    with_tcmalloc()
    try:
        main(args)
    except ValueError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    except KeyboardInterrupt:
        print(f"{p.prog}: interrupted", file=sys.stderr)
        sys.exit(130)
