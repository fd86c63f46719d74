"""Fashion-MNIST as loaded, verified and batched."""

import contextlib
import gzip
import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import pytest

from jax_dp import data, fashion_mnist


def test_splits_have_the_published_sizes_and_class_counts(fashion_train, fashion_test):
    for split, n in ((fashion_train, 60_000), (fashion_test, 10_000)):
        assert split.images.shape == (n, 28, 28, 1) and split.images.dtype == np.float32
        assert split.labels.shape == (n,) and split.labels.dtype == np.int32
        np.testing.assert_array_equal(np.bincount(split.labels, minlength=10), [n // 10] * 10)
        assert split.images.min() == 0.0 and split.images.max() == 1.0


def test_pixels_are_the_idx_files_bytes_over_255(fashion_test):
    name = "t10k-images-idx3-ubyte"
    raw = np.frombuffer(fashion_mnist.read_idx(fashion_mnist.idx_path(fashion_mnist.DEBIAN_DIR, name),
                                               name), np.uint8, offset=16).reshape(-1, 28 * 28)
    loaded = np.round(fashion_test.images.reshape(-1, 28 * 28) * 255).astype(np.uint8)
    # TFDS stores examples in its own order; the multisets of images must agree.
    assert sorted(map(bytes, raw)) == sorted(map(bytes, loaded))


def test_limit_takes_the_first_examples(fashion_test):
    head = data.load_fashion_mnist("test", limit=100)
    np.testing.assert_array_equal(head.labels, fashion_test.labels[:100])


@pytest.fixture
def source_copy(tmp_path):
    """A writable copy of the four IDX files and an empty TFDS data dir."""
    src = tmp_path / "src"
    shutil.copytree(fashion_mnist.DEBIAN_DIR, src)
    return src, tmp_path / "tfds"


def test_a_flipped_byte_is_refused_before_preparing_starts(source_copy, capsys):
    src, tfds_dir = source_copy
    path = src / "t10k-labels-idx1-ubyte.gz"  # Read last while preparing: after the train split.
    raw = bytearray(gzip.decompress(path.read_bytes()))
    raw[100] ^= 1
    path.write_bytes(gzip.compress(bytes(raw)))
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte.gz is corrupted .*apt-get install"):
        data.load_fashion_mnist("test", tfds_dir=tfds_dir, idx_dir=src)
    assert "preparing Fashion-MNIST" not in capsys.readouterr().err
    assert not (tfds_dir / "fashion_mnist_idx" / "1.0.0").exists()  # Nothing half-prepared.


def test_a_truncated_file_is_refused(source_copy):
    src, tfds_dir = source_copy
    path = src / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz is truncated or corrupted"):
        data.load_fashion_mnist("train", tfds_dir=tfds_dir, idx_dir=src)


def test_a_missing_file_is_named(source_copy):
    src, tfds_dir = source_copy
    (src / "train-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(ValueError, match="train-labels-idx1-ubyte\\(.gz\\) is missing from"):
        data.load_fashion_mnist("train", tfds_dir=tfds_dir, idx_dir=src, source="debian")


def test_unknown_split_and_source_are_refused():
    with pytest.raises(ValueError, match="unknown split 'valid'"):
        data.load_fashion_mnist("valid")
    with pytest.raises(ValueError, match="unknown data 'web': use one of auto, debian, download"):
        data.load_fashion_mnist("test", source="web")


def small_split(n):
    return data.Split(np.arange(n, dtype=np.float32).reshape(n, 1, 1, 1), np.arange(n, dtype=np.int32))


@pytest.mark.parametrize("n,batch_size,k", [(10, 4, 1), (10, 4, 3), (7, 7, 2), (5, 8, 4)])
def test_batches_cover_every_example_once_in_equal_padded_shapes(n, batch_size, k):
    seen = []
    order = data.epoch_order(n, jax.random.key(0))
    for batch in data.batches(small_split(n), batch_size, pad_to=k, order=order):
        assert batch["image"].shape[0] == batch["label"].shape[0] == data.padded_size(batch_size, k)
        assert batch["image"].shape[0] % k == 0
        real = batch["mask"] == 1
        assert not batch["image"][~real].any()
        seen.extend(batch["label"][real])
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("real,batch_size,k,per_device", [
    (96, 512, 2, [48, 48]),  # The book's last batch at 512 on 2 GPUs.
    (5, 8, 4, [2, 1, 1, 1]), (3, 8, 4, [1, 1, 1, 0]), (1, 4, 2, [1, 0]), (10, 10, 4, [3, 3, 2, 2])])
def test_a_padded_batch_spreads_its_real_rows_over_the_devices(real, batch_size, k, per_device):
    """Catches padding that leaves a device with padding alone while another holds two real
    rows more (per-device BatchNorm then normalises over nothing), or real rows out of order."""
    split = small_split(batch_size + real)
    last = list(data.batches(split, batch_size, pad_to=k))[-1]
    assert last["mask"].reshape(k, -1).sum(1).tolist() == per_device
    assert last["label"][last["mask"] == 1].tolist() == list(range(batch_size, batch_size + real))


def test_epoch_order_is_a_permutation_fixed_by_the_key():
    a, b, c = (data.epoch_order(10, jax.random.key(s)) for s in (3, 3, 4))
    assert sorted(a) == list(range(10))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_batches_follow_the_order_from_start_and_drop_remainder_drops_the_tail():
    split, order = small_split(10), np.array([9, 8, 7, 6, 5, 4, 3, 2, 1, 0])
    labels = [list(b["label"]) for b in data.batches(split, 4, order=order, start=1)]
    assert labels == [[5, 4, 3, 2], [1, 0, 0, 0]]  # The last batch is padded (mask 0).
    assert [len(b["label"]) for b in data.batches(split, 4, drop_remainder=True)] == [4, 4]
    assert data.num_batches(10, 4) == 3 and data.num_batches(10, 4, drop_remainder=True) == 2


def test_processes_started_together_prepare_the_data_once(tmp_path, fashion_test):
    """Catches the race of two processes preparing one fresh data dir (parallel test workers,
    the ranks of a multi-process run): TFDS's second rename used to fail."""
    script = ("import sys; from jax_dp import data; "
              "s = data.load_fashion_mnist('test', tfds_dir=sys.argv[1]); "
              "print(int(s.labels.sum()), float(s.images.sum()))")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[1][1][-500:] or outs[0][1][-500:]
    lasts = [out.strip().splitlines()[-1] for out, _ in outs]  # TFDS prints its own lines first.
    assert lasts == [f"{int(fashion_test.labels.sum())} {float(fashion_test.images.sum())}"] * 2
    assert sum("preparing Fashion-MNIST" in err for _, err in outs) == 1


@pytest.fixture(scope="session")
def freshly_prepared(tmp_path_factory):
    """A TFDS data dir this session prepared from Debian's files (its checksums recorded by the
    preparation), before any run read it. One for all xdist workers (their temp folders share a
    parent): the preparation's lock lets the first prepare it and the others wait."""
    root = tmp_path_factory.getbasetemp()
    data_dir = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "prepared"
    data._prepare(data_dir, fashion_mnist.DEBIAN_DIR, None)
    return data_dir


@pytest.fixture
def prepared_copy(tmp_path, freshly_prepared):
    """A copy of a freshly prepared TFDS data dir, its checksum record included."""
    shutil.copytree(freshly_prepared / "fashion_mnist_idx", tmp_path / "fashion_mnist_idx")
    return tmp_path


def flip_a_byte(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 1
    path.write_bytes(bytes(raw))


def test_the_preparation_records_what_it_wrote_before_any_run_reads_it(prepared_copy):
    """Catches checksums taken at the first read, which vouch for whatever changed before it:
    a byte flipped in the train split between preparing and the first run is refused."""
    folder = prepared_copy / "fashion_mnist_idx" / "1.0.0"
    record = json.loads((folder / data.CHECKSUMS).read_text())
    assert sorted(record) == sorted(p.name for p in folder.iterdir() if p.name != data.CHECKSUMS)
    assert {"dataset_info.json", "features.json"} <= set(record)
    (path,) = folder.glob("*-train.array_record*")
    flip_a_byte(path)
    data.load_fashion_mnist("test", tfds_dir=prepared_copy, limit=8)  # The other split is intact.
    with pytest.raises(ValueError, match=rf"{path} is not what was prepared \(its SHA-256 is not "
                                         rf"the one recorded in {folder / data.CHECKSUMS}\): "
                                         rf"delete {folder} and run again to prepare it anew"):
        data.load_fashion_mnist("train", tfds_dir=prepared_copy, limit=8)
    assert json.loads((folder / data.CHECKSUMS).read_text()) == record  # Nothing re-recorded.


def test_an_edited_dataset_info_is_refused_naming_it(prepared_copy):
    """Catches a record of the data files alone: dataset_info.json pointed the train split at the
    test file (and its length at 10,000), and a run trained on the test set."""
    folder = prepared_copy / "fashion_mnist_idx" / "1.0.0"
    info = json.loads((folder / "dataset_info.json").read_text())
    train = next(split for split in info["splits"] if split["name"] == "train")
    train["filepathTemplate"] = "{DATASET}-test.{FILEFORMAT}-{SHARD_X_OF_Y}"
    train["shardLengths"] = ["10000"]
    (folder / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match=rf"^{folder / 'dataset_info.json'} is not what was "
                                         r"prepared .*: delete .* and run again to prepare it anew"):
        data.load_fashion_mnist("train", tfds_dir=prepared_copy, limit=8)


def test_prepared_data_without_its_record_is_refused_not_vouched_for(prepared_copy):
    folder = prepared_copy / "fashion_mnist_idx" / "1.0.0"
    (folder / data.CHECKSUMS).unlink()
    with pytest.raises(ValueError, match=rf"{folder} holds prepared data without the checksums its "
                                         rf"preparation records \(sha256.json\): delete {folder}"):
        data.load_fashion_mnist("test", tfds_dir=prepared_copy, limit=8)
    assert not (folder / data.CHECKSUMS).exists()


def test_a_prepared_file_that_cannot_be_parsed_is_one_line_with_the_fix(prepared_copy):
    """A preparation that wrote a file Riegeli cannot read (its checksum then agrees)."""
    folder = prepared_copy / "fashion_mnist_idx" / "1.0.0"
    (path,) = folder.glob("*-test.array_record*")
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
    data.record_checksums(folder)
    with pytest.raises(ValueError, match=rf"^cannot read the prepared test split in {folder} "
                                         rf"\(.*\): delete {folder} and run again"):
        data.load_fashion_mnist("test", tfds_dir=prepared_copy)


def test_a_garbled_checksum_record_is_one_line_with_the_fix(prepared_copy):
    record = prepared_copy / "fashion_mnist_idx" / "1.0.0" / data.CHECKSUMS
    record.write_text("{garbage")
    with pytest.raises(ValueError, match=rf"{record} cannot be read \(JSONDecodeError\): delete "
                                         rf"{record.parent}"):
        data.load_fashion_mnist("test", tfds_dir=prepared_copy, limit=8)


def test_a_full_disk_while_preparing_is_one_line_and_leaves_nothing_trusted(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(small)],
                      capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    try:
        for _ in range(2):  # A second run meets the same line, not half-prepared data.
            with pytest.raises(ValueError, match=rf"^cannot prepare Fashion-MNIST in {small} \(No "
                                                 r"space left on device\): free some space, or "
                                                 r"pass another tfds_dir"):
                data.load_fashion_mnist("test", tfds_dir=small, limit=8)
        assert not list(small.rglob(data.CHECKSUMS))
    finally:
        subprocess.run(["umount", "--lazy", str(small)], check=True)


def test_a_read_only_data_dir_that_holds_the_data_still_loads(prepared_copy, monkeypatch):
    """Users share datasets: nothing needs writing once the data are prepared."""
    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(data.Path, "write_text", read_only)
    monkeypatch.setattr(data.Path, "mkdir", read_only)
    assert len(data.load_fashion_mnist("test", tfds_dir=prepared_copy, limit=8).labels) == 8
    with pytest.raises(ValueError, match=r"cannot prepare Fashion-MNIST in .*empty \(Read-only file "
                                         r"system\): pass a writable tfds_dir \(or set TFDS_DATA_DIR\)"):
        data.load_fashion_mnist("test", tfds_dir=prepared_copy / "empty", limit=8)


def test_a_download_without_the_network_is_refused_at_once_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_reachable", lambda url: False)
    with pytest.raises(ValueError, match=rf"^Fashion-MNIST is not prepared in {tmp_path / 'tfds'} and "
                                         r"its download \(http://fashion-mnist.s3-website.*\) is not "
                                         r"reachable: connect to the network, or use data debian"):
        data.load_fashion_mnist("test", source="download", tfds_dir=tmp_path / "tfds")
    assert list(tmp_path.iterdir()) == []


@contextlib.contextmanager
def mirror(files: dict[str, bytes], cut: str | None = None):
    """An HTTP server on 127.0.0.1 serving files by name, as TFDS's fashion_mnist URL serves them
    (the file named cut is sent half, then the connection closes): its base URL."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = files.get(self.path.lstrip("/"))
            if body is None:
                return self.send_error(404)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:len(body) // 2] if self.path.lstrip("/") == cut else body)
            self.close_connection = True

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        server.server_close()


def debian_files() -> dict[str, bytes]:
    """Debian's four .gz files by name (recompressed: not the bytes TFDS registers)."""
    return {f"{name}.gz": (Path(fashion_mnist.DEBIAN_DIR) / f"{name}.gz").read_bytes()
            for name in fashion_mnist.FILES}


def test_a_download_from_a_mirror_prepares_debians_images_and_trains(tmp_path, fashion_train,
                                                                      fashion_test):
    """With Debian's folder out of sight, the default --data auto downloads the four files
    (here from a mirror on loopback), prepares them, and a LeNet run trains on the result:
    the same 60,000 + 10,000 images and labels as Debian's, in the same order."""
    tfds_dir = tmp_path / "tfds"
    with mirror(debian_files()) as url:
        proc = subprocess.run(
            [sys.executable, "-m", "experiments.lenet", "--devices", "1", "--epochs", "1",
             "--batch-size", "128", "--train-examples", "256", "--test-examples", "256",
             "--idx-dir", str(tmp_path / "not-debian"), "--download-url", url,
             "--tfds-dir", str(tfds_dir), "--no-progress"],
            capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr
    assert f"downloading Fashion-MNIST from {url}" in proc.stderr and "epoch 1, time" in proc.stdout
    for split, want in (("train", fashion_train), ("test", fashion_test)):
        got = data.load_fashion_mnist(split, source="debian", tfds_dir=tfds_dir,
                                      idx_dir=tmp_path / "not-debian")  # Prepared: never read.
        np.testing.assert_array_equal(got.images, want.images)
        np.testing.assert_array_equal(got.labels, want.labels)


def unprepared(tfds_dir) -> bool:
    """Nothing in tfds_dir that a run would trust: no prepared dataset, no checksum record."""
    return (not fashion_mnist.FashionMnistIdx(data_dir=str(tfds_dir)).is_prepared()
            and not list(Path(tfds_dir).rglob(data.CHECKSUMS)))


def test_a_damaged_download_is_refused_by_tfds_checksum_and_nothing_is_prepared(tmp_path):
    """TFDS checks each download against the checksum registered for its URL (here the mirror's
    own, given as a TFDS checksums file): one flipped byte is one line, and the damaged download
    is deleted, not kept for the next run to reuse."""
    files = debian_files()
    damaged = dict(files, **{"train-labels-idx1-ubyte.gz": bytes(
        b ^ (i == 100) for i, b in enumerate(files["train-labels-idx1-ubyte.gz"]))})
    tfds_dir = tmp_path / "tfds"
    with mirror(damaged) as url:
        checksums = tmp_path / "checksums.tsv"
        checksums.write_text("".join(
            f"{url}{name}\t{len(body)}\t{hashlib.sha256(body).hexdigest()}\t{name}\n"
            for name, body in files.items()))
        with pytest.raises(ValueError, match=rf"^{url}train-labels-idx1-ubyte.gz does not match the "
                                             r"checksum TFDS registers for it .*: nothing was "
                                             r"prepared, and the download was deleted"):
            data.load_fashion_mnist("test", source="download", tfds_dir=tfds_dir, url=url,
                                    checksums=checksums)
    assert unprepared(tfds_dir) and not (tfds_dir / "downloads" / "fashion_mnist_idx").exists()


def test_an_interrupted_download_leaves_nothing_a_later_run_trusts(tmp_path):
    tfds_dir = tmp_path / "tfds"
    with mirror(debian_files(), cut="train-images-idx3-ubyte.gz") as url:
        with pytest.raises(ValueError, match=rf"^downloading Fashion-MNIST from {url} failed .*: "
                                             r"nothing was prepared, and the download was deleted"):
            data.load_fashion_mnist("test", source="download", tfds_dir=tfds_dir, url=url)
    assert unprepared(tfds_dir) and not (tfds_dir / "downloads" / "fashion_mnist_idx").exists()


def test_importing_the_library_silences_no_logger_and_its_notices_are_logged():
    """Logging is the caller's: the library sets no level at import, and says that it prepares
    the data through its own named logger (the CLI shows only its own lines)."""
    script = ("import logging; from jax_dp import checkpoint, data, train; "
              "print(logging.getLogger('absl').level, logging.getLogger('absl').disabled, "
              "data.logger.name)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "False", "jax_dp.data"]
