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
    result = _load("hf_gpt2_char").main(["--text", str(text), "--steps", "30", "--smoke"])
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
    cmd = [sys.executable, str(EXAMPLES / "hf_gpt2_char.py"), "--text", str(text), "--steps", "2", "--smoke"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)  # as a user runs it, in a fresh process
    assert done.returncode == 0, done.stderr[-2000:]
    assert "token_id" not in done.stderr + done.stdout, done.stderr


@pytest.fixture(scope="module")
def trained_hf_run(tmp_path_factory):
    """An hf_trainer.py run of 8 steps with checkpoints at 4 and 8, and the arguments that resume it to step 12."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    base = tmp_path_factory.mktemp("hf_trainer")
    text = base / "corpus.txt"
    text.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\nSpeak, speak.\n" * 60)
    small = ["--text", str(text), "--batch", "4", "--context", "16", "--width", "32", "--layers", "1"]
    small += ["--save-steps", "4", "--windows", "200"]
    _load("hf_trainer").main(["--out", str(base / "run"), "--steps", "8", *small])
    return base / "run", small


def _damage_optimizer(path: Path, how: str) -> None:
    raw = path.read_bytes()
    if how == "missing":
        path.unlink()
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif how == "garbage":
        path.write_bytes(b"\x00\x17garbage" * 64)
    elif how == "plain layout":  # model.safetensors as save_pretrained of a stiefelized model writes it
        from safetensors.torch import load_file, save_file

        weights = load_file(path)
        save_file({k: v for k, v in weights.items() if ".parametrizations." not in k}, path)
    else:  # it loads: non-finite moments, or a few finite values changed
        import torch

        state = torch.load(path, weights_only=True)
        moment = state["state"][0]["exp_avg"]  # the token embedding's (AdamW's)
        moment.view(-1)[:3] = float("nan") if how.startswith("nan") else 0.5
        torch.save(state, path)
        if how == "nan, no checksums":  # as a checkpoint saved before checksums were written
            (path.parent / "checksums.json").unlink(missing_ok=True)


# how optimizer.pt (or the model's weights) of the last checkpoint is damaged, and what --resume says
HF_DAMAGE = [
    (
        "missing",
        "{file} is missing: the optimizer state (StiefelAdam's moments and step counts) cannot be restored",
    ),
    ("empty", "{file} cannot be read: it is empty (0 bytes)"),
    ("truncated", "{file} cannot be read: it is not a complete torch.save archive"),
    ("garbage", "{file} cannot be read: it is not a complete torch.save archive"),
    ("nan", "{file} has changed since it was saved (sha256 "),
    ("floats changed", "{file} has changed since it was saved (sha256 "),
    ("nan, no checksums", "{file} holds non-finite values (the exp_avg of parameter 0): it is damaged"),
    (
        "plain layout",
        "{file} does not hold the model's frames (3 of 3 missing, e.g. transformer.h.0.attn.c_attn.parametrizations",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("how,said", HF_DAMAGE, ids=[how for how, _ in HF_DAMAGE])
def test_hf_trainer_resume_refuses_a_checkpoint_that_cannot_continue_the_run_naming_the_file(
    trained_hf_run, tmp_path, how, said
):
    """The Trainer itself starts a fresh optimizer when optimizer.pt is missing, and fails with `[Errno 22]`, a bare
    EOFError or a NonFiniteGradientError blaming the learning rate when it is damaged; it loads weights without the
    frames (strict=False) leaving them at their initial values: the script refuses first, naming the file and the
    checkpoint to resume from instead."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(trained_hf_run[0], out)
    damaged = out / "checkpoint-8" / ("model.safetensors" if how == "plain layout" else "optimizer.pt")
    _damage_optimizer(damaged, how)
    with pytest.raises(SystemExit) as stop:
        _load("hf_trainer").main(["--out", str(out), "--steps", "12", "--resume", *trained_hf_run[1]])
    message = str(stop.value)
    assert message.startswith("--resume: " + said.format(file=damaged)), message
    assert message.endswith(
        f"; move {out / 'checkpoint-8'} aside to resume from {out / 'checkpoint-4'}, the checkpoint before it"
    )
