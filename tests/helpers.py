"""Helpers several test files share (fake CIFAR-10 on disk, CLI argument lists)."""

from __future__ import annotations

import pickle
import tarfile
from pathlib import Path

import numpy as np


def write_pickle_batches(folder: Path, train_labels: np.ndarray, test_labels: np.ndarray, seed: int = 0) -> dict:
    """A canonical cifar-10-batches-py in folder (train split into 5 batches); returns the expected arrays."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    xs, ys = [], []
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name, labels in zip(names, [*np.array_split(np.asarray(train_labels), 5), np.asarray(test_labels)]):
        x = rng.integers(0, 256, size=(len(labels), 3072), dtype=np.uint8)
        batch = {b"batch_label": name.encode(), b"data": x, b"labels": [int(v) for v in labels]}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
        xs.append(x.reshape(-1, 3, 32, 32))
        ys.append(np.asarray(labels, dtype=np.int64))
    return {"train_x": np.concatenate(xs[:5]), "train_y": np.concatenate(ys[:5]), "test_x": xs[5], "test_y": ys[5]}


def make_tar(source: Path, archive: Path, arcname: str = "") -> Path:
    """Tar.gz the *contents* of ``source``, optionally under a wrapping folder ``arcname``."""
    with tarfile.open(archive, "w:gz") as tar:
        for child in sorted(source.iterdir()):
            tar.add(child, arcname=f"{arcname}/{child.name}" if arcname else child.name)
    return archive


def smoke_args(family: str, experiment: str, out, *extra: str) -> list[str]:
    """argv of one smoke-profile experiment run in this process, without a progress bar."""
    return [
        family,
        "--experiment",
        experiment,
        "--profile",
        "smoke",
        "--out",
        str(out),
        "--jobs",
        "1",
        "--no-progress",
        *extra,
    ]
