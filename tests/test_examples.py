"""The examples in examples/ run at smoke size (they are what a user copies first)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_gpt2_char_example(tmp_path):
    pytest.importorskip("transformers")
    text = tmp_path / "corpus.txt"
    text.write_text("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 30)
    result = _load("hf_gpt2_char").main(["--data", str(text), "--steps", "30", "--smoke"])
    assert result["isometry"] < 1e-5 and result["val_loss"] < 3.0  # below the uniform 3.3 nats of ~27 characters


def test_encoder_classifier_example():
    result = _load("encoder_classifier").main(["--steps", "60", "--smoke"])
    assert result["isometry"] < 1e-5 and result["accuracy"] > result["majority"] + 0.05
