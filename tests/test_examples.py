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


@pytest.mark.slow
def test_hf_trainer_example_resumes_from_a_checkpoint_exactly(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    text = tmp_path / "corpus.txt"
    text.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\nSpeak, speak.\n" * 60)
    small = ["--text", str(text), "--batch", "4", "--context", "16", "--width", "32", "--layers", "1"]
    small += ["--save-steps", "4", "--windows", "200"]
    trainer = _load("hf_trainer")
    whole = trainer.main(["--out", str(tmp_path / "whole"), "--steps", "12", *small])
    assert sorted(whole["losses"]) == list(range(1, 13)) and whole["isometry"] < 1e-5
    first = trainer.main(["--out", str(tmp_path / "stopped"), "--steps", "8", *small])  # stops at step 8
    assert (tmp_path / "stopped" / "checkpoint-8").is_dir()
    rest = trainer.main(["--out", str(tmp_path / "stopped"), "--steps", "12", "--resume", *small])
    assert sorted(rest["losses"]) == list(range(1, 13)) and rest["step"] == 12  # steps 1-8 from the checkpoint
    for step in range(1, 9):
        assert first["losses"][step] == whole["losses"][step]
    for step in range(9, 13):  # resumed: the same losses as the run that never stopped
        assert rest["losses"][step] == pytest.approx(whole["losses"][step], abs=1e-6)
    assert rest["val_loss"] == pytest.approx(whole["val_loss"], abs=1e-6)


def test_the_hf_example_configs_carry_no_warning_to_ignore(tmp_path):
    import subprocess
    import sys

    pytest.importorskip("transformers")
    text = tmp_path / "corpus.txt"
    text.write_text("To be, or not to be, that is the question:\n" * 40)
    cmd = [sys.executable, str(EXAMPLES / "hf_gpt2_char.py"), "--data", str(text), "--steps", "2", "--smoke"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)  # as a user runs it, in a fresh process
    assert done.returncode == 0, done.stderr[-2000:]
    assert "token_id" not in done.stderr + done.stdout, done.stderr
