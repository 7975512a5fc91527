"""Character-level text for the language-model testbed: one UTF-8 file, a character vocabulary, a split.

The default corpus is tiny Shakespeare (`../shared/datasets/tinyshakespeare.txt`; provenance and
sha256 in ../shared/datasets/README.md); any UTF-8 text file can stand in (`--text PATH` or
$STIEFEL_ATTENTION_TEXT). The first 90% of the characters train, the last 10% validate.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from .errors import DataError

__all__ = [
    "ENV_TEXT",
    "DEFAULT_TEXT_CANDIDATES",
    "DEFAULT_TEXT_SHA256",
    "CharCorpus",
    "check_windows",
    "load_text",
    "random_windows",
    "fixed_windows",
]

ENV_TEXT = "STIEFEL_ATTENTION_TEXT"
# Tried in order, relative to the working directory, when neither a path nor the variable is given.
DEFAULT_TEXT_CANDIDATES = ("data/tinyshakespeare.txt", "../shared/datasets/tinyshakespeare.txt")
# sha256 of tiny Shakespeare (../shared/datasets/README.md): the text the committed results were made from. A run on
# any other text carries that text's hash in its config, so its record can never be mistaken for one of these.
DEFAULT_TEXT_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TRAIN_FRACTION = 0.9
_EXPECTED = (
    "expected a UTF-8 text file, e.g. tiny Shakespeare (the char-rnn / nanoGPT corpus, 1,115,394 "
    f"characters); pass --text PATH, set {ENV_TEXT}=PATH, or put it at "
    f"{' or '.join(DEFAULT_TEXT_CANDIDATES)}"
)


@dataclass(frozen=True, eq=False)
class CharCorpus:
    """A text as int64 character ids, its vocabulary, and the train/validation split."""

    chars: str  # the vocabulary, sorted; id i is chars[i]
    train: torch.Tensor  # (n_train,) int64
    val: torch.Tensor  # (n_val,) int64
    source: str
    sha256: str = ""  # of the file's bytes

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def _resolve(path: str | os.PathLike[str] | None) -> Path:
    if path is not None:
        where = Path(path)
    elif os.environ.get(ENV_TEXT, "").strip():
        where = Path(os.environ[ENV_TEXT].strip())
    else:
        found = [Path.cwd() / c for c in DEFAULT_TEXT_CANDIDATES if (Path.cwd() / c).is_file()]
        if not found:
            raise DataError(f"no text corpus found: {_EXPECTED}")
        where = found[0]
    if not where.is_file():
        raise DataError(f"{where} is not a file: {_EXPECTED}")
    return where.resolve()


def load_text(path: str | os.PathLike[str] | None = None) -> CharCorpus:
    """The corpus at path (or the default), checked: a missing, empty or undecodable file is one DataError."""
    where = _resolve(path)
    try:
        raw = where.read_bytes()
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{where} is not UTF-8 text (byte {err.start} cannot be decoded): {_EXPECTED}") from None
    except OSError as err:
        raise DataError(f"cannot read {where}: {err.strerror}") from None
    if len(text) < 100:
        raise DataError(f"{where} holds {len(text)} characters, too few to train and validate on: {_EXPECTED}")
    chars = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.int64)
    n_train = int(TRAIN_FRACTION * len(ids))
    return CharCorpus(chars, ids[:n_train], ids[n_train:], str(where), hashlib.sha256(raw).hexdigest())


def check_windows(corpus: CharCorpus, context: int) -> None:
    """Every part a run draws windows of `context` + 1 characters from is long enough (DataError otherwise):
    the training part, the validation part, and the two parts of the training text the lr sweep uses."""
    cut = int(TRAIN_FRACTION * len(corpus.train))  # the sweep's held-out training text, as lm.run splits it
    parts = {
        "the validation part (the last 10%)": len(corpus.val),
        "the training part": len(corpus.train),
        "the lr sweep's held-out training text (the last 10% of the training part)": len(corpus.train) - cut,
        "the lr sweep's training text": cut,
    }
    need = context + 2  # a window and its next character, with at least two start positions
    short = {name: n for name, n in parts.items() if n < need}
    if short:
        held = "; ".join(f"{name} holds {n}" for name, n in short.items())
        raise DataError(
            f"{corpus.source} is too short for a context of {context} characters: {held}, fewer than the {need} "
            f"characters a window needs; use a longer text (at least about {int(need / 0.09) + 1} characters) or a "
            "profile with a shorter context"
        )


def random_windows(data: torch.Tensor, batch: int, context: int, generator: torch.Generator):
    """(x, y): `batch` windows of `context` characters and the characters that follow each, (B, T) each."""
    starts = torch.randint(0, len(data) - context - 1, (batch,), generator=generator)
    offsets = torch.arange(context + 1)
    seq = data[starts[:, None] + offsets]  # (B, T + 1)
    return seq[:, :-1], seq[:, 1:]


def fixed_windows(data: torch.Tensor, n: int, context: int, seed: int = 0):
    """A seeded set of n windows, the same in every run that asks for the same (n, context, seed)."""
    return random_windows(data, n, context, torch.Generator().manual_seed(seed))


@lru_cache(maxsize=2)
def cached_text(data: str | None) -> CharCorpus:
    """load_text(data), kept for the two most recent sources (a command plans and runs many cells on one text)."""
    return load_text(data)
