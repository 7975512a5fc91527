"""Tests for stiefel_attention.bench.cifar.data (CIFAR-10 part), on tiny generated datasets."""

from __future__ import annotations

import hashlib
import io
import pickle
import urllib.error
import urllib.request
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import make_tar, write_pickle_batches
from stiefel_attention.bench.cifar import data
from stiefel_attention.bench.cifar.data import (
    CIFAR10_CLASSES,
    CIFAR10_MEAN,
    CIFAR10_STD,
    ENV_CACHE,
    ENV_CIFAR10,
    DataError,
    balanced_subset,
    download_cifar10,
    load_cifar10,
    normalize,
    resolve_cifar_source,
    train_val_split,
)

REAL_ARCHIVE = Path(__file__).resolve().parents[1] / ".." / "shared" / "datasets" / "cifar10-jpeg.tar.gz"


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Never read the developer's env settings or write to the real ~/.cache.
    monkeypatch.delenv(ENV_CIFAR10, raising=False)
    monkeypatch.setenv(ENV_CACHE, str(tmp_path / "default-cache"))


# ---------------------------------------------------------------------------
# Fake dataset builders
# ---------------------------------------------------------------------------


def make_pickle_dir(root: Path, per_batch: int = 20, seed: int = 0) -> dict[str, np.ndarray]:
    """Write a canonical-layout cifar-10-batches-py; return the expected arrays."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=6 * per_batch)
    return write_pickle_batches(root / "cifar-10-batches-py", labels[: 5 * per_batch], labels[5 * per_batch :], seed)


def make_image_dir(
    root: Path, per_class: tuple[int, int] = (2, 1), suffix: str = ".png", seed: int = 0
) -> dict[str, np.ndarray]:
    """Write train/<class>/NNNN<suffix> and test/...; return expected arrays (label, name order)."""
    rng = np.random.default_rng(seed)
    expected: dict[str, np.ndarray] = {}
    for split, count in zip(("train", "test"), per_class):
        xs, ys = [], []
        for label, class_name in enumerate(CIFAR10_CLASSES):
            class_dir = root / split / class_name
            class_dir.mkdir(parents=True)
            # Written in reverse so the loader has to sort by name.
            images = [rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8) for _ in range(count)]
            for i in reversed(range(count)):
                Image.fromarray(images[i]).save(class_dir / f"{i:04d}{suffix}")
            xs += [img.transpose(2, 0, 1) for img in images]
            ys += [label] * count
        expected[f"{split}_x"] = np.stack(xs)
        expected[f"{split}_y"] = np.array(ys, dtype=np.int64)
    return expected


def assert_matches(loaded: data.Cifar10, expected: dict[str, np.ndarray]) -> None:
    for name in ("train_x", "train_y", "test_x", "test_y"):
        tensor = getattr(loaded, name)
        assert tensor.dtype == (torch.uint8 if name.endswith("_x") else torch.int64), name
        np.testing.assert_array_equal(tensor.numpy(), expected[name], err_msg=name)


def assert_helpful(err: pytest.ExceptionInfo[DataError], *fragments: str) -> None:
    message = str(err.value)
    for fragment in ("--data", ENV_CIFAR10, "train/<class>", "cifar-10-batches-py", *fragments):
        assert fragment in message, f"{fragment!r} missing from: {message}"


# ---------------------------------------------------------------------------
# Loading each layout
# ---------------------------------------------------------------------------


def test_pickle_folder_and_its_parent_load_exactly(tmp_path: Path) -> None:
    expected = make_pickle_dir(tmp_path / "src")
    cache = tmp_path / "cache"
    loaded = load_cifar10(tmp_path / "src" / "cifar-10-batches-py", cache_dir=cache)
    assert_matches(loaded, expected)
    assert loaded.train_x.shape == (100, 3, 32, 32) and loaded.test_x.shape == (20, 3, 32, 32)
    assert_matches(load_cifar10(tmp_path / "src", cache_dir=cache), expected)


def test_canonical_archive_loads_exactly(tmp_path: Path) -> None:
    expected = make_pickle_dir(tmp_path / "src")
    archive = make_tar(tmp_path / "src", tmp_path / "cifar-10-python.tar.gz")
    loaded = load_cifar10(archive, cache_dir=tmp_path / "cache")
    assert_matches(loaded, expected)
    assert loaded.source == str(archive.resolve())


def test_png_folder_and_archives_load_identically(tmp_path: Path) -> None:
    expected = make_image_dir(tmp_path / "images")
    plain = make_tar(tmp_path / "images", tmp_path / "plain.tar.gz")
    wrapped = make_tar(tmp_path / "images", tmp_path / "wrapped.tar.gz", arcname="cifar10")
    cache = tmp_path / "cache"
    for source in (tmp_path / "images", plain, wrapped):
        assert_matches(load_cifar10(source, cache_dir=cache), expected)
    # Three different sources -> three cache entries.
    assert len(list(cache.glob("cifar10-*"))) == 3


def test_jpeg_folder_loads(tmp_path: Path) -> None:
    expected = make_image_dir(tmp_path / "images", suffix=".jpg")
    loaded = load_cifar10(tmp_path / "images", cache_dir=tmp_path / "cache")
    assert loaded.train_x.shape == (20, 3, 32, 32) and loaded.test_x.shape == (10, 3, 32, 32)
    np.testing.assert_array_equal(loaded.train_y.numpy(), expected["train_y"])
    np.testing.assert_array_equal(loaded.test_y.numpy(), expected["test_y"])
    # JPEG is lossy: each image must be exactly what Pillow decodes from its own file, channels first,
    # in label-then-name order (a swapped file, channel order or transpose would not be)
    for split in ("train", "test"):
        files = sorted(
            (tmp_path / "images" / split).glob("*/*.jpg"), key=lambda f: (CIFAR10_CLASSES.index(f.parent.name), f.name)
        )
        decoded = np.stack([np.asarray(Image.open(f).convert("RGB")).transpose(2, 0, 1) for f in files])
        np.testing.assert_array_equal(getattr(loaded, f"{split}_x").numpy(), decoded, err_msg=split)
        assert np.abs(decoded.astype(int) - expected[f"{split}_x"]).mean() < 64  # and near what was written


# ---------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------


def _fail_decode(*args: object) -> None:
    raise AssertionError("decoder called although a valid cache exists")


def test_cache_is_written_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = make_image_dir(tmp_path / "images")
    archive = make_tar(tmp_path / "images", tmp_path / "images.tar.gz")
    cache = tmp_path / "cache"
    load_cifar10(archive, cache_dir=cache)
    (entry,) = cache.iterdir()  # exactly one entry, no temp leftovers
    assert sorted(p.name for p in entry.iterdir()) == [
        "meta.json",
        "test_x.npy",
        "test_y.npy",
        "train_x.npy",
        "train_y.npy",
    ]
    monkeypatch.setattr(data, "_decode_source", _fail_decode)
    assert_matches(load_cifar10(archive, cache_dir=cache), expected)


def test_cache_dir_defaults_to_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_pickle_dir(tmp_path / "src")
    monkeypatch.setenv(ENV_CACHE, str(tmp_path / "from-env"))
    load_cifar10(tmp_path / "src")
    assert len(list((tmp_path / "from-env").glob("cifar10-*/meta.json"))) == 1


def test_changed_source_is_decoded_again(tmp_path: Path) -> None:
    make_image_dir(tmp_path / "images")
    cache = tmp_path / "cache"
    load_cifar10(tmp_path / "images", cache_dir=cache)
    replaced = tmp_path / "images" / "train" / "cat" / "0000.png"
    Image.new("RGB", (32, 32), (1, 2, 3)).save(replaced)
    loaded = load_cifar10(tmp_path / "images", cache_dir=cache)
    first_cat = CIFAR10_CLASSES.index("cat") * 2
    assert loaded.train_x[first_cat, :, 0, 0].tolist() == [1, 2, 3]
    assert len(list(cache.iterdir())) == 2


@pytest.mark.parametrize("damage", ["flip_pixel_byte", "garbage_meta", "missing_labels"])
def test_corrupt_cache_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    expected = make_pickle_dir(tmp_path / "src")
    cache = tmp_path / "cache"
    load_cifar10(tmp_path / "src", cache_dir=cache)
    (entry,) = cache.iterdir()
    if damage == "flip_pixel_byte":
        raw = bytearray((entry / "train_x.npy").read_bytes())
        raw[-1] ^= 0xFF
        (entry / "train_x.npy").write_bytes(bytes(raw))
    elif damage == "garbage_meta":
        (entry / "meta.json").write_text("{not json")
    else:
        (entry / "train_y.npy").unlink()

    with pytest.warns(UserWarning, match="corrupt"):
        assert_matches(load_cifar10(tmp_path / "src", cache_dir=cache), expected)
    # The rebuilt cache is valid again: no decode, no warning.
    monkeypatch.setattr(data, "_decode_source", _fail_decode)
    assert_matches(load_cifar10(tmp_path / "src", cache_dir=cache), expected)


# ---------------------------------------------------------------------------
# Bad sources
# ---------------------------------------------------------------------------


def test_nonexistent_path(tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        load_cifar10(tmp_path / "nope", cache_dir=tmp_path / "cache")
    assert_helpful(err, "does not exist", "nope")


def test_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError) as err:
        load_cifar10(tmp_path / "empty", cache_dir=tmp_path / "cache")
    assert_helpful(err, "not a CIFAR-10 layout")


def test_random_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello, not a dataset\n" * 100)
    with pytest.raises(DataError) as err:
        load_cifar10(path, cache_dir=tmp_path / "cache")
    assert_helpful(err, "not a readable tar archive")


def test_truncated_archive(tmp_path: Path) -> None:
    make_image_dir(tmp_path / "images")
    archive = make_tar(tmp_path / "images", tmp_path / "images.tar.gz")
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(DataError) as err:
        load_cifar10(archive, cache_dir=tmp_path / "cache")
    assert_helpful(err, "images.tar.gz")


def test_archive_with_wrong_layout(tmp_path: Path) -> None:
    (tmp_path / "junk" / "photos").mkdir(parents=True)
    (tmp_path / "junk" / "photos" / "a.txt").write_text("x")
    archive = make_tar(tmp_path / "junk", tmp_path / "junk.tar.gz")
    with pytest.raises(DataError) as err:
        load_cifar10(archive, cache_dir=tmp_path / "cache")
    assert_helpful(err, "holds neither", "photos")


def test_incomplete_pickle_folder_names_missing_file(tmp_path: Path) -> None:
    make_pickle_dir(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(DataError) as err:
        load_cifar10(tmp_path, cache_dir=tmp_path / "cache")
    assert_helpful(err, "missing data_batch_3")


def test_corrupt_and_foreign_pickles(tmp_path: Path) -> None:
    make_pickle_dir(tmp_path)
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    batch.write_bytes(b"\x80\x02garbage")
    with pytest.raises(DataError) as err:
        load_cifar10(tmp_path, cache_dir=tmp_path / "cache")
    assert_helpful(err, "data_batch_2")
    # A pickle that needs anything beyond numpy arrays is refused, not executed.
    batch.write_bytes(pickle.dumps(OrderedDict(data=1), protocol=2))
    with pytest.raises(DataError, match="refusing to load collections.OrderedDict"):
        load_cifar10(tmp_path, cache_dir=tmp_path / "cache")


def test_out_of_range_labels(tmp_path: Path) -> None:
    make_pickle_dir(tmp_path)
    batch = {b"data": np.zeros((3, 3072), np.uint8), b"labels": [0, 10, 1]}
    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(DataError, match="labels outside 0..9"):
        load_cifar10(tmp_path, cache_dir=tmp_path / "cache")


def test_split_without_images(tmp_path: Path) -> None:
    make_image_dir(tmp_path / "images")
    for image in (tmp_path / "images" / "test").glob("*/*.png"):
        image.unlink()
    with pytest.raises(DataError) as err:
        load_cifar10(tmp_path / "images", cache_dir=tmp_path / "cache")
    assert_helpful(err, "test split has no images")


def test_bad_images(tmp_path: Path) -> None:
    make_image_dir(tmp_path / "images")
    cache = tmp_path / "cache"
    big = tmp_path / "images" / "train" / "dog" / "0001.png"
    Image.new("RGB", (64, 32)).save(big)
    with pytest.raises(DataError, match="64x32, expected 32x32"):
        load_cifar10(tmp_path / "images", cache_dir=cache)
    big.write_bytes(b"not a png")
    with pytest.raises(DataError, match="Cannot decode image .*dog/0001.png"):
        load_cifar10(tmp_path / "images", cache_dir=cache)
    big.unlink()
    (tmp_path / "images" / "train" / "dragon").mkdir()
    Image.new("RGB", (32, 32)).save(tmp_path / "images" / "train" / "dragon" / "0.png")
    with pytest.raises(DataError, match="Unknown class folder 'dragon'"):
        load_cifar10(tmp_path / "images", cache_dir=cache)


# ---------------------------------------------------------------------------
# Resolving the source
# ---------------------------------------------------------------------------


def test_resolution_priority(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    explicit, from_env, default = (tmp_path / name for name in ("explicit", "env", "work"))
    explicit.mkdir()
    from_env.mkdir()
    (default / "data" / "cifar-10-batches-py").mkdir(parents=True)
    monkeypatch.chdir(default)
    assert resolve_cifar_source(None) == (default / "data" / "cifar-10-batches-py").resolve()
    monkeypatch.setenv(ENV_CIFAR10, str(from_env))
    assert resolve_cifar_source(None) == from_env.resolve()
    assert resolve_cifar_source(explicit) == explicit.resolve()
    assert resolve_cifar_source(str(explicit)) == explicit.resolve()


def test_env_var_pointing_nowhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_CIFAR10, str(tmp_path / "missing"))
    with pytest.raises(DataError) as err:
        resolve_cifar_source(None)
    assert_helpful(err, "from the environment variable")


def test_nothing_found_lists_what_was_tried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    workdir = tmp_path / "a" / "b"  # so ../shared/... cannot exist either
    workdir.mkdir(parents=True)
    monkeypatch.chdir(workdir)
    with pytest.raises(DataError) as err:
        load_cifar10(cache_dir=tmp_path / "cache")
    assert_helpful(err, "cifar10-jpeg.tar.gz", "download_cifar10", str(workdir / "data"))


# ---------------------------------------------------------------------------
# Download (network replaced by a fake urlopen)
# ---------------------------------------------------------------------------


FakeArchive = tuple[bytes, dict[str, np.ndarray]]  # (archive bytes, expected arrays)


@pytest.fixture
def fake_archive(tmp_path: Path) -> FakeArchive:
    expected = make_pickle_dir(tmp_path / "served")
    archive = make_tar(tmp_path / "served", tmp_path / "served.tar.gz")
    return archive.read_bytes(), expected


def serve(monkeypatch: pytest.MonkeyPatch, payload: bytes) -> list[str]:
    requested: list[str] = []

    def fake_urlopen(url: str, timeout: float | None = None) -> io.BytesIO:
        requested.append(url)
        return io.BytesIO(payload)

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    return requested


def test_download_verifies_and_extracts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_archive: FakeArchive
) -> None:
    payload, expected = fake_archive
    requested = serve(monkeypatch, payload)
    dest = tmp_path / "downloads"
    folder = download_cifar10(dest, md5=hashlib.md5(payload).hexdigest())
    assert folder == dest / "cifar-10-batches-py"
    assert requested == [data.CIFAR10_URL]
    assert sorted(p.name for p in dest.iterdir()) == [
        "cifar-10-batches-py",
        "cifar-10-python.tar.gz",
    ]
    assert_matches(load_cifar10(folder, cache_dir=tmp_path / "cache"), expected)
    # Already there: no second download.
    assert download_cifar10(dest, md5=hashlib.md5(payload).hexdigest()) == folder
    assert len(requested) == 1


def test_download_with_wrong_checksum_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_archive: FakeArchive
) -> None:
    serve(monkeypatch, fake_archive[0])  # default md5 is the real archive's: mismatch
    dest = tmp_path / "downloads"
    with pytest.raises(DataError) as err:
        download_cifar10(dest)
    assert_helpful(err, "md5", data.CIFAR10_MD5)
    assert list(dest.iterdir()) == []


def test_download_network_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(url: str, timeout: float | None = None) -> io.BytesIO:
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(DataError, match="no network"):
        download_cifar10(tmp_path / "downloads")
    assert list((tmp_path / "downloads").iterdir()) == []


# ---------------------------------------------------------------------------
# normalize, balanced_subset, train_val_split
# ---------------------------------------------------------------------------


def test_normalize_known_values() -> None:
    mean, std = torch.tensor(CIFAR10_MEAN), torch.tensor(CIFAR10_STD)
    x = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
    x[0] = 255
    out = normalize(x)
    assert out.dtype == torch.float32 and out.shape == x.shape
    torch.testing.assert_close(out[0, :, 1, 2], (1 - mean) / std)
    torch.testing.assert_close(out[1, :, 0, 0], -mean / std)
    # A single image (3, H, W) works the same way.
    torch.testing.assert_close(normalize(x[0]), out[0])
    # Images equal to the channel means map to ~0 (up to 8-bit rounding).
    at_mean = (mean * 255).round().to(torch.uint8).view(3, 1, 1).expand(3, 8, 8)
    assert normalize(at_mean).abs().max() < 0.5 / 255 / std.min()
    with pytest.raises(TypeError):
        normalize(x.float())


def _labels(per_class: int = 30, seed: int = 0) -> torch.Tensor:
    labels = torch.arange(10).repeat_interleave(per_class)
    return labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))]


def test_balanced_subset_counts_and_determinism() -> None:
    labels = _labels()
    idx = balanced_subset(labels, 53, torch.Generator().manual_seed(1))
    assert idx.dtype == torch.int64 and len(idx) == 53 and len(idx.unique()) == 53
    counts = torch.bincount(labels[idx], minlength=10)
    assert sorted(counts.tolist()) == [5] * 7 + [6] * 3
    again = balanced_subset(labels, 53, torch.Generator().manual_seed(1))
    other = balanced_subset(labels, 53, torch.Generator().manual_seed(2))
    assert torch.equal(idx, again) and not torch.equal(idx, other)
    full = balanced_subset(labels, 300, torch.Generator().manual_seed(1))
    assert torch.equal(full, torch.arange(300))


@pytest.mark.parametrize("n", [0, 9, 301])
def test_balanced_subset_rejects_bad_sizes(n: int) -> None:
    with pytest.raises(ValueError, match="balanced_subset"):
        balanced_subset(_labels(), n, torch.Generator().manual_seed(0))


def test_balanced_subset_rejects_short_class() -> None:
    labels = torch.cat([torch.arange(10).repeat(5), torch.zeros(50, dtype=torch.long)])
    with pytest.raises(ValueError, match="only 5 exist"):
        balanced_subset(labels, 60, torch.Generator().manual_seed(0))


def test_train_val_split() -> None:
    labels = _labels()
    train_idx, val_idx = train_val_split(labels, 40, torch.Generator().manual_seed(3))
    assert len(val_idx) == 40 and len(train_idx) == 260
    assert torch.equal(torch.sort(torch.cat([train_idx, val_idx])).values, torch.arange(300))
    assert torch.bincount(labels[val_idx], minlength=10).tolist() == [4] * 10
    train_again, val_again = train_val_split(labels, 40, torch.Generator().manual_seed(3))
    assert torch.equal(train_idx, train_again) and torch.equal(val_idx, val_again)
    train_all, val_none = train_val_split(labels, 0, torch.Generator().manual_seed(3))
    assert torch.equal(train_all, torch.arange(300)) and len(val_none) == 0
    with pytest.raises(ValueError):
        train_val_split(labels, 300, torch.Generator().manual_seed(3))


# ---------------------------------------------------------------------------
# The real JPEG mirror (about 15 s; skipped where it is not present)
# ---------------------------------------------------------------------------


@pytest.mark.skipif(not REAL_ARCHIVE.exists(), reason=f"{REAL_ARCHIVE} not present")
def test_real_jpeg_archive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cifar = load_cifar10(REAL_ARCHIVE, cache_dir=tmp_path / "cache")
    assert cifar.train_x.shape == (50000, 3, 32, 32) and cifar.test_x.shape == (10000, 3, 32, 32)
    assert torch.bincount(cifar.train_y).tolist() == [5000] * 10
    assert torch.bincount(cifar.test_y).tolist() == [1000] * 10
    means = cifar.train_x.float().div_(255).mean(dim=(0, 2, 3))
    torch.testing.assert_close(means, torch.tensor([0.4913, 0.4821, 0.4465]), atol=2e-3, rtol=0)

    # The second load must come from the uint8 cache: decoding is made impossible.
    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded again instead of reading the cache")

    monkeypatch.setattr(data, "_decode_source", no_decoding)
    cached = load_cifar10(REAL_ARCHIVE, cache_dir=tmp_path / "cache")
    assert torch.equal(cached.train_x, cifar.train_x) and torch.equal(cached.test_y, cifar.test_y)
