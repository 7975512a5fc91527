"""CIFAR-10 for the benchmark suite: find a source, decode it once into a uint8 cache, index it.

CIFAR-10 can come from three places:

* the canonical python release: the ``cifar-10-batches-py`` folder (pickles
  ``data_batch_1..5`` and ``test_batch``), a folder containing it, or the
  ``cifar-10-python.tar.gz`` archive;
* an image layout: a folder or ``.tar.gz`` with ``train/<class>/*.jpg|*.png``
  and ``test/<class>/*.jpg|*.png`` (optionally wrapped in one top-level folder),
  e.g. the JPEG mirror ``shared/datasets/cifar10-jpeg.tar.gz``;
* ``download_cifar10``, which fetches and verifies the canonical archive.

Whatever the source, it is decoded once into a uint8 cache (raw ``.npy`` files
plus a JSON sidecar holding a sha256 of the arrays), so later loads take well
under a second. Every user-facing problem is raised as ``DataError`` with one
message that says how to point the code at the data.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import logging
import os
import pickle
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from PIL import Image

from ..errors import DataError


class SourceNotFound(DataError):
    """No CIFAR-10 source was given and none was found in the usual places (a download can fix this)."""


log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# CIFAR-10 constants
# ---------------------------------------------------------------------------

CIFAR10_CLASSES: tuple[str, ...] = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)
# Per-channel statistics of the canonical CIFAR-10 train split, in [0, 1] units.
CIFAR10_MEAN: tuple[float, float, float] = (0.4914, 0.4822, 0.4465)
CIFAR10_STD: tuple[float, float, float] = (0.2470, 0.2435, 0.2616)

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_ARCHIVE_NAME = "cifar-10-python.tar.gz"
CIFAR10_PICKLE_DIR = "cifar-10-batches-py"

ENV_CIFAR10 = "STIEFEL_ATTENTION_CIFAR10"
# arrays_sha256 of the shared JPEG mirror (../shared/datasets/cifar10-jpeg.tar.gz, archive sha256 0bfcb687...)
# as decoded here: the data the committed results were made from. A run on any other pixels carries its data's
# hash in its config, so its record can never be mistaken for one of these.
DEFAULT_CIFAR10_SHA256 = "a3b9405504972b0ee0b18a7ebcf6cdc203aeee589ee59eda8b6a6bc0f1d9720b"
ENV_CACHE = "STIEFEL_ATTENTION_CACHE"

# Tried in order, relative to the current working directory, when neither an
# explicit path nor the environment variable is given.
DEFAULT_CIFAR10_CANDIDATES: tuple[str, ...] = (
    "data/cifar-10-batches-py",
    "data/cifar10-jpeg.tar.gz",
    "../shared/datasets/cifar10-jpeg.tar.gz",
)

_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
_TEST_BATCH = "test_batch"
_PICKLE_FILES = (*_TRAIN_BATCHES, _TEST_BATCH)
_SPLITS = ("train", "test")
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
_IMAGE_SHAPE = (3, 32, 32)
_ARRAY_NAMES = ("train_x", "train_y", "test_x", "test_y")
# Bump when the cache layout or decoding changes, so old caches are not reused.
_CACHE_VERSION = 1

_HOW_TO_PROVIDE = (
    "How to provide CIFAR-10: pass --data PATH (or the `source` argument), or set "
    f"the environment variable {ENV_CIFAR10}=PATH, or put it at one of "
    f"{', '.join(DEFAULT_CIFAR10_CANDIDATES)} (relative to the working directory).\n"
    "Accepted layouts:\n"
    f"  (a) the canonical '{CIFAR10_PICKLE_DIR}' folder (data_batch_1..5, test_batch), "
    f"a folder containing it, or the '{CIFAR10_ARCHIVE_NAME}' archive;\n"
    "  (b) a folder or .tar.gz with train/<class>/*.jpg|*.png and "
    "test/<class>/*.jpg|*.png (optionally inside one top-level folder), classes "
    f"{', '.join(CIFAR10_CLASSES)}.\n"
    "To download the canonical archive (needs network): "
    'python -c "from stiefel_attention.bench.cifar.data import download_cifar10; '
    "download_cifar10('data')\""
)


def _data_error(problem: str) -> DataError:
    # One message: the specific problem first, then the ways to provide the data.
    return DataError(f"{problem}\n{_HOW_TO_PROVIDE}")


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no scalar ==
class Cifar10:
    """CIFAR-10 as uint8 images (N, 3, 32, 32) and int64 labels in 0..9."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    source: str  # resolved path the data was read from
    sha256: str = ""  # of the decoded arrays (`arrays_sha256`): what a run trains and evaluates on, whatever the format

    classes: ClassVar[tuple[str, ...]] = CIFAR10_CLASSES

    def __repr__(self) -> str:
        return f"Cifar10(train={tuple(self.train_x.shape)}, test={tuple(self.test_x.shape)}, source={self.source!r})"


# ---------------------------------------------------------------------------
# Finding the source
# ---------------------------------------------------------------------------


def resolve_cifar_source(path: str | os.PathLike[str] | None = None) -> Path:
    """Return the CIFAR-10 source path to use.

    Priority: explicit ``path`` > env ``STIEFEL_ATTENTION_CIFAR10`` > the first
    existing entry of ``DEFAULT_CIFAR10_CANDIDATES`` (relative to the cwd).
    Only existence is checked here; the layout is checked when loading.
    """
    if path is not None:
        return _existing(Path(path), "given via --data / the source argument")

    from_env = os.environ.get(ENV_CIFAR10, "").strip()
    if from_env:
        return _existing(Path(from_env), f"from the environment variable {ENV_CIFAR10}")

    cwd = Path.cwd()
    tried = [cwd / candidate for candidate in DEFAULT_CIFAR10_CANDIDATES]
    for candidate in tried:
        if candidate.exists():
            return candidate.resolve()
    raise SourceNotFound(
        _data_error(
            "No CIFAR-10 source found: no --data path given, "
            f"{ENV_CIFAR10} is not set, and none of these exist: " + ", ".join(str(t) for t in tried) + "."
        ).args[0]
    )


def _existing(path: Path, origin: str) -> Path:
    path = path.expanduser()
    if not path.exists():
        raise _data_error(f"CIFAR-10 source {str(path)!r} ({origin}) does not exist.")
    return path.resolve()


@dataclass(frozen=True)
class _Located:
    """A source whose kind is known: 'pickle_dir', 'image_dir' or 'archive'."""

    kind: str
    root: Path


def _locate(path: Path) -> _Located:
    """Work out what ``path`` is, cheaply (no decoding, archives are not opened)."""
    if path.is_file():
        # Archive contents are only inspected while decoding, so a cached
        # archive never has to be decompressed again.
        return _Located("archive", path)
    if not path.is_dir():
        raise _data_error(f"CIFAR-10 source {str(path)!r} is neither a file nor a folder.")

    for root in (path, path / CIFAR10_PICKLE_DIR):
        present = [name for name in _PICKLE_FILES if (root / name).is_file()]
        if len(present) == len(_PICKLE_FILES):
            return _Located("pickle_dir", root)
        if present:
            missing = [name for name in _PICKLE_FILES if name not in present]
            raise _data_error(
                f"Folder {str(root)!r} looks like '{CIFAR10_PICKLE_DIR}' but is missing {', '.join(missing)}."
            )

    subfolders = [p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")]
    # One wrapping top-level folder is allowed, as in many image-layout archives.
    roots = [path] + (subfolders if len(subfolders) == 1 else [])
    for root in roots:
        if all((root / split).is_dir() for split in _SPLITS):
            return _Located("image_dir", root)

    archives = sorted(p.name for p in path.glob("*.tar*"))
    hint = f" It contains archives {archives}: pass one of them instead." if archives else ""
    listing = sorted(p.name for p in path.iterdir())[:10]
    raise _data_error(f"Folder {str(path)!r} is not a CIFAR-10 layout (found {listing or 'nothing'})." + hint)


# ---------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------

Arrays = dict[str, np.ndarray]  # keys: _ARRAY_NAMES


def _decode_source(located: _Located) -> Arrays:
    """Decode a located source into uint8 CHW images and int64 labels (slow path)."""
    if located.kind == "pickle_dir":
        raw = {}
        for name in _PICKLE_FILES:
            try:
                raw[name] = (located.root / name).read_bytes()
            except OSError as err:
                raise _data_error(f"Cannot read {located.root / name}: {err}.") from err
        return _arrays_from_pickles(raw, str(located.root))
    if located.kind == "image_dir":
        return _arrays_from_images(_iter_folder_images(located.root), str(located.root))
    return _decode_archive(located.root)


def _decode_archive(path: Path) -> Arrays:
    """Read a tar archive in one streaming pass and decode whichever layout it holds."""
    pickles: dict[str, bytes] = {}
    images: list[tuple[str, int, str, bytes]] = []
    prefixes: set[str] = set()  # the optional wrapping folder; "" when none
    seen: list[str] = []
    try:
        # Streaming mode ('r|*'): one forward pass over the compressed stream.
        with tarfile.open(path, mode="r|*") as tar:
            for member in tar:
                if len(seen) < 10:
                    seen.append(member.name)
                if not member.isfile():
                    continue
                parts = tuple(p for p in member.name.split("/") if p not in ("", "."))
                if parts and parts[-1] in _PICKLE_FILES:
                    pickles[parts[-1]] = _read_member(tar, member)
                    continue
                key = _image_key(parts, max_depth=4, where=f"{path}:{member.name}")
                if key is not None:
                    split, label = key
                    prefixes.add("/".join(parts[:-3]))
                    images.append((split, label, parts[-1], _read_member(tar, member)))
    except (tarfile.TarError, EOFError, zlib.error, OSError) as err:
        raise _data_error(f"CIFAR-10 source {str(path)!r} is a file but not a readable tar archive ({err}).") from err

    if all(name in pickles for name in _PICKLE_FILES):
        return _arrays_from_pickles(pickles, str(path))
    if images:
        if len(prefixes) > 1:
            raise _data_error(
                f"Archive {str(path)!r} has train/ and test/ under several top-level folders "
                f"({sorted(prefixes)}); expected at most one wrapping folder."
            )
        return _arrays_from_images(iter(images), str(path))
    if pickles:
        missing = [name for name in _PICKLE_FILES if name not in pickles]
        raise _data_error(f"Archive {str(path)!r} is missing {', '.join(missing)}.")
    raise _data_error(
        f"Archive {str(path)!r} holds neither '{CIFAR10_PICKLE_DIR}' pickles nor "
        f"train/<class>/ and test/<class>/ images (first entries: {seen or 'none'})."
    )


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    handle = tar.extractfile(member)
    if handle is None:  # not a regular file; callers filtered these already
        return b""
    return handle.read()


def _image_key(parts: tuple[str, ...], max_depth: int, where: str) -> tuple[str, int] | None:
    """Map path parts ``[wrapper/]split/class/file.ext`` to (split, label), else None."""
    if not 3 <= len(parts) <= max_depth:
        return None
    split, class_name, file_name = parts[-3:]
    if split not in _SPLITS or file_name.startswith("."):
        return None
    if not file_name.lower().endswith(_IMAGE_SUFFIXES):
        return None
    if class_name not in CIFAR10_CLASSES:
        raise _data_error(
            f"Unknown class folder {class_name!r} at {where}; expected one of {', '.join(CIFAR10_CLASSES)}."
        )
    return split, CIFAR10_CLASSES.index(class_name)


def _iter_folder_images(root: Path) -> Iterator[tuple[str, int, str, bytes]]:
    for split in _SPLITS:
        for class_dir in sorted((root / split).iterdir()):
            if not class_dir.is_dir() or class_dir.name.startswith("."):
                continue
            for file in sorted(class_dir.iterdir()):
                key = _image_key((split, class_dir.name, file.name), max_depth=3, where=str(file))
                if key is None or not file.is_file():
                    continue
                try:
                    data = file.read_bytes()
                except OSError as err:
                    raise _data_error(f"Cannot read {file}: {err}.") from err
                yield key[0], key[1], file.name, data


def _arrays_from_images(entries: Iterator[tuple[str, int, str, bytes]], where: str) -> Arrays:
    """Decode (split, label, file name, bytes) entries; order: label, then file name."""
    by_split: dict[str, list[tuple[int, str, bytes]]] = {split: [] for split in _SPLITS}
    for split, label, name, data in entries:
        by_split[split].append((label, name, data))

    arrays: Arrays = {}
    for split, items in by_split.items():
        if not items:
            raise _data_error(f"CIFAR-10 source {where!r}: the {split} split has no images.")
        items.sort(key=lambda item: (item[0], item[1]))  # deterministic order
        images = np.empty((len(items), *_IMAGE_SHAPE), dtype=np.uint8)
        for i, (label, name, data) in enumerate(items):
            images[i] = _decode_image(data, f"{where}: {split}/{CIFAR10_CLASSES[label]}/{name}")
        arrays[f"{split}_x"] = images
        arrays[f"{split}_y"] = np.array([label for label, _, _ in items], dtype=np.int64)
    return arrays


def _decode_image(data: bytes, where: str) -> np.ndarray:
    try:
        with Image.open(io.BytesIO(data)) as image:
            rgb = image.convert("RGB")
    except Exception as err:  # Pillow raises many types on malformed files
        raise _data_error(f"Cannot decode image {where}: {err}.") from err
    if rgb.size != (32, 32):
        raise _data_error(f"Image {where} is {rgb.size[0]}x{rgb.size[1]}, expected 32x32.")
    return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)  # HWC -> CHW


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler for CIFAR-10 batches that refuses everything except numpy arrays.

    The canonical batches need only numpy's array reconstruction, so refusing all
    other globals keeps a foreign pickle from running code.
    """

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # python-3 protocol-2 pickles encode bytes this way
    }

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        # numpy 2 renamed numpy.core to numpy._core; go there directly.
        if module == "numpy.core.multiarray" and importlib.util.find_spec("numpy._core"):
            module = "numpy._core.multiarray"
        return super().find_class(module, name)


def _read_pickle_batch(raw: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        # encoding="bytes": the batches were written by python 2, keys are bytes.
        batch = _NumpyOnlyUnpickler(io.BytesIO(raw), encoding="bytes").load()
        data = np.asarray(batch[b"data"])
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except Exception as err:  # any failure here means a bad or foreign file
        raise _data_error(f"Cannot read CIFAR-10 batch {where}: {type(err).__name__}: {err}.") from err
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise _data_error(f"CIFAR-10 batch {where} has data {data.dtype} {data.shape}, expected uint8 (N, 3072).")
    # Rows are stored channel-major (1024 R, 1024 G, 1024 B), i.e. already CHW.
    return data.reshape(-1, *_IMAGE_SHAPE), labels


def _arrays_from_pickles(raw: dict[str, bytes], where: str) -> Arrays:
    train = [_read_pickle_batch(raw[name], f"{where}/{name}") for name in _TRAIN_BATCHES]
    test_x, test_y = _read_pickle_batch(raw[_TEST_BATCH], f"{where}/{_TEST_BATCH}")
    return {
        "train_x": np.concatenate([x for x, _ in train]),
        "train_y": np.concatenate([y for _, y in train]),
        "test_x": test_x,
        "test_y": test_y,
    }


def _check_arrays(arrays: Arrays, where: str) -> None:
    """Validate shapes, dtypes and labels; a split may be small but not empty."""
    for split in _SPLITS:
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if len(x) == 0:
            raise _data_error(f"CIFAR-10 source {where!r}: the {split} split has no images.")
        if x.dtype != np.uint8 or x.shape[1:] != _IMAGE_SHAPE:
            raise _data_error(
                f"CIFAR-10 source {where!r}: {split} images are {x.dtype} {x.shape}, expected uint8 (N, 3, 32, 32)."
            )
        if y.shape != (len(x),):
            raise _data_error(f"CIFAR-10 source {where!r}: {len(x)} {split} images but labels of shape {y.shape}.")
        if y.min() < 0 or y.max() >= len(CIFAR10_CLASSES):
            raise _data_error(f"CIFAR-10 source {where!r}: {split} labels outside 0..9 (min {y.min()}, max {y.max()}).")


# ---------------------------------------------------------------------------
# Cache: <cache_dir>/cifar10-<fingerprint>/{train_x,train_y,test_x,test_y}.npy + meta.json
# ---------------------------------------------------------------------------


def _default_cache_dir() -> Path:
    from_env = os.environ.get(ENV_CACHE, "").strip()
    return Path(from_env).expanduser() if from_env else Path.home() / ".cache" / "stiefel-attention"


def _fingerprint(located: _Located) -> str:
    """Hash of what identifies the source's content without reading it."""
    digest = hashlib.sha256(f"v{_CACHE_VERSION}\n{located.kind}\n{located.root}\n".encode())
    if located.kind == "archive":
        files = [located.root]
    elif located.kind == "pickle_dir":
        files = [located.root / name for name in _PICKLE_FILES]
    else:
        files = sorted(
            Path(dirpath) / name
            for split in _SPLITS
            for dirpath, _, names in os.walk(located.root / split)
            for name in names
        )
    for file in files:
        stat = file.stat()
        name = file.relative_to(located.root.parent)
        digest.update(f"{name}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def arrays_sha256(arrays: Arrays) -> str:
    """sha256 of the decoded arrays (names, dtypes, shapes and bytes): the same for every layout of the same pixels."""
    digest = hashlib.sha256()
    for name in _ARRAY_NAMES:
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{array.dtype.str}:{array.shape}\n".encode())
        digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


def _read_cache(entry: Path) -> tuple[Arrays, str] | None:
    """Return the cached arrays and their sha256, or None if absent or corrupt (corrupt -> warning)."""
    if not entry.exists():
        return None
    try:
        meta = json.loads((entry / "meta.json").read_text())
        arrays = {name: np.load(entry / f"{name}.npy", allow_pickle=False) for name in _ARRAY_NAMES}
        if meta.get("version") != _CACHE_VERSION:
            raise ValueError(f"cache version {meta.get('version')}, expected {_CACHE_VERSION}")
        sha256 = arrays_sha256(arrays)
        if sha256 != meta.get("sha256"):
            raise ValueError("sha256 of the cached arrays does not match meta.json")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, EOFError) as err:
        warnings.warn(f"CIFAR-10 cache {entry} is corrupt ({err}); rebuilding it.", stacklevel=3)
        return None
    return arrays, sha256


def _write_cache(entry: Path, arrays: Arrays, source: str, sha256: str) -> None:
    """Write the cache atomically: fill a temp folder, then rename it into place."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=entry.parent))
    except OSError as err:
        warnings.warn(f"Cannot create CIFAR-10 cache in {entry.parent} ({err}); not caching.", stacklevel=3)
        return
    try:
        for name in _ARRAY_NAMES:
            np.save(tmp / f"{name}.npy", arrays[name], allow_pickle=False)
        meta = {
            "version": _CACHE_VERSION,
            "source": source,
            "sha256": sha256,
            "shapes": {name: list(arrays[name].shape) for name in _ARRAY_NAMES},
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if entry.exists():  # a corrupt entry we decided to rebuild
            shutil.rmtree(entry)
        os.replace(tmp, entry)
    except OSError as err:
        # Includes losing a race with another process writing the same entry,
        # whose content is identical; either way the data in hand is fine.
        warnings.warn(f"Cannot write CIFAR-10 cache {entry} ({err}); not caching.", stacklevel=3)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------
# Public loading API
# ---------------------------------------------------------------------------


def load_cifar10(
    source: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Cifar10:
    """Load CIFAR-10 as uint8 tensors, decoding the source only on the first call.

    ``source`` is resolved by ``resolve_cifar_source``. ``cache_dir`` defaults to
    env ``STIEFEL_ATTENTION_CACHE`` or ``~/.cache/stiefel-attention``. Images are
    ordered by label, then by file name (image layouts) or batch order (pickles).
    """
    path = resolve_cifar_source(source)
    cache_root = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_dir()
    try:
        located = _locate(path)
        entry = cache_root / f"cifar10-{_fingerprint(located)[:20]}"
        cached = _read_cache(entry)
        if cached is not None:
            arrays, sha256 = cached
        else:
            log.info("decoding CIFAR-10 from %s (cached afterwards in %s)", path, entry)
            arrays = _decode_source(located)
            _check_arrays(arrays, str(path))
            sha256 = arrays_sha256(arrays)
            _write_cache(entry, arrays, source=str(path), sha256=sha256)
    except OSError as err:  # e.g. permissions; the helpers wrap the expected cases
        raise _data_error(f"Cannot read CIFAR-10 source {str(path)!r}: {err}.") from err

    return Cifar10(
        train_x=torch.from_numpy(arrays["train_x"]),
        train_y=torch.from_numpy(arrays["train_y"]),
        test_x=torch.from_numpy(arrays["test_x"]),
        test_y=torch.from_numpy(arrays["test_y"]),
        source=str(path),
        sha256=sha256,
    )


def download_cifar10(
    dest_dir: str | os.PathLike[str],
    url: str | None = None,
    md5: str | None = None,
) -> Path:
    """Download, verify (md5) and extract the canonical CIFAR-10 python archive.

    Returns ``dest_dir/cifar-10-batches-py``. An existing extracted folder is
    reused; an existing archive is reused if its checksum matches. A download
    with the wrong checksum is deleted and raises ``DataError``.
    """
    url, md5 = url or CIFAR10_URL, md5 or CIFAR10_MD5  # looked up at call time (tests point them elsewhere)
    dest = Path(dest_dir).expanduser()
    target = dest / CIFAR10_PICKLE_DIR
    if all((target / name).is_file() for name in _PICKLE_FILES):
        return target
    archive = dest / CIFAR10_ARCHIVE_NAME
    try:
        dest.mkdir(parents=True, exist_ok=True)
        if not (archive.is_file() and _md5_of_file(archive) == md5):
            _download_verified(url, archive, md5)
        _extract_pickle_dir(archive, target)
    except OSError as err:
        raise _data_error(f"Cannot write CIFAR-10 into {str(dest)!r}: {err}.") from err
    return target


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def _progress(response, url: str):
    """A tqdm bar over the download's bytes (its size from Content-Length), or nothing without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    length = getattr(response, "headers", {}).get("Content-Length") if hasattr(response, "headers") else None
    return tqdm(total=int(length) if length else None, unit="B", unit_scale=True, desc=url.rsplit("/", 1)[-1])


def _md5_of_file(path: Path) -> str:
    digest = hashlib.md5()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download_verified(url: str, archive: Path, md5: str) -> None:
    """Stream ``url`` into a temp file, check md5, then rename it to ``archive``."""
    log.info("downloading %s to %s", url, archive)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{archive.name}.", suffix=".part", dir=archive.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.md5()
        with os.fdopen(fd, "wb") as out:
            try:
                # Looked up at call time so tests can monkeypatch urllib.request.urlopen.
                with urllib.request.urlopen(url, timeout=60) as response, _progress(response, url) as bar:
                    for chunk in iter(lambda: response.read(1 << 20), b""):
                        digest.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
            except (urllib.error.URLError, OSError, ValueError) as err:
                raise _data_error(
                    f"Downloading {url} failed ({err}). Download it by other means and "
                    "pass the archive or its extracted folder with --data."
                ) from err
        if digest.hexdigest() != md5:
            raise _data_error(
                f"Download of {url} has md5 {digest.hexdigest()}, expected {md5}; "
                "the file was deleted. Retry, or download it by other means."
            )
        os.replace(tmp, archive)
    finally:
        tmp.unlink(missing_ok=True)


def _extract_pickle_dir(archive: Path, target: Path) -> None:
    """Extract ``cifar-10-batches-py`` from the archive via a temp folder, atomically."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        try:
            with tarfile.open(archive, mode="r:*") as tar:
                # filter="data" refuses absolute paths, links out of tree, devices.
                tar.extractall(tmp, filter="data")
        except (tarfile.TarError, EOFError, zlib.error) as err:
            raise _data_error(f"Cannot extract {archive}: {err}.") from err
        extracted = tmp / CIFAR10_PICKLE_DIR
        if not all((extracted / name).is_file() for name in _PICKLE_FILES):
            raise _data_error(f"Archive {archive} does not contain a complete '{CIFAR10_PICKLE_DIR}'.")
        if target.exists():  # an incomplete earlier extraction
            shutil.rmtree(target)
        os.replace(extracted, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------
# Preprocessing and index selection
# ---------------------------------------------------------------------------


def normalize(x_uint8: torch.Tensor) -> torch.Tensor:
    """uint8 images (..., 3, H, W) -> float32, scaled to [0, 1], standardised per channel."""
    if x_uint8.dtype != torch.uint8:
        # Guards against normalising twice or feeding already-scaled floats.
        raise TypeError(f"normalize expects uint8 images, got {x_uint8.dtype}")
    if x_uint8.ndim < 3 or x_uint8.shape[-3] != 3:
        raise ValueError(f"normalize expects (..., 3, H, W), got shape {tuple(x_uint8.shape)}")
    mean = torch.tensor(CIFAR10_MEAN, device=x_uint8.device).view(3, 1, 1)
    std = torch.tensor(CIFAR10_STD, device=x_uint8.device).view(3, 1, 1)
    return (x_uint8.float() / 255.0 - mean) / std


def _label_vector(labels: torch.Tensor) -> torch.Tensor:
    if labels.ndim != 1 or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be a 1-D integer tensor, got {labels.dtype} {tuple(labels.shape)}")
    return labels.detach().cpu().long()


def balanced_subset(labels: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """Indices (int64, sorted, CPU) of a class-balanced random subset of size ``n``.

    Each class present in ``labels`` gets ``n // C`` examples; the ``n % C``
    leftover slots go to the first classes of a generator-drawn class
    permutation. All randomness comes from ``generator``.
    """
    labels = _label_vector(labels)
    classes = torch.unique(labels)  # sorted
    num_classes = len(classes)
    if n < num_classes:
        raise ValueError(f"balanced_subset: n={n} is smaller than the {num_classes} classes")
    if n > len(labels):
        raise ValueError(f"balanced_subset: n={n} exceeds the {len(labels)} available examples")

    per_class = torch.full((num_classes,), n // num_classes, dtype=torch.long)
    extra = torch.randperm(num_classes, generator=generator)[: n % num_classes]
    per_class[extra] += 1

    chosen = []
    for label, count in zip(classes.tolist(), per_class.tolist()):
        members = torch.nonzero(labels == label).squeeze(1)
        if count > len(members):
            raise ValueError(
                f"balanced_subset: n={n} needs {count} examples of class {label}, but only {len(members)} exist"
            )
        chosen.append(members[torch.randperm(len(members), generator=generator)[:count]])
    return torch.sort(torch.cat(chosen)).values


def train_val_split(labels: torch.Tensor, n_val: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Split train-set indices into (train_idx, val_idx); val is class-balanced.

    Carve the validation set from the TRAIN split only: the test split is never
    used to choose hyper-parameters. ``n_val=0`` returns all indices as train.
    Both index tensors are int64, sorted, disjoint and together cover ``labels``.
    """
    labels = _label_vector(labels)
    if n_val == 0:
        return torch.arange(len(labels)), torch.empty(0, dtype=torch.long)
    if n_val >= len(labels):
        raise ValueError(f"train_val_split: n_val={n_val} leaves no training examples of {len(labels)}")
    val_idx = balanced_subset(labels, n_val, generator)
    is_train = torch.ones(len(labels), dtype=torch.bool)
    is_train[val_idx] = False
    return torch.nonzero(is_train).squeeze(1), val_idx
