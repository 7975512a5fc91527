"""Checkpoints that are checked (issue 39): a grokking run's partial checkpoint and a pretrained checkpoint whose
bytes changed but still parse are never used; a partial checkpoint that cannot be applied, or whose run then fails,
is deleted with the reason said; an unreadable file is described, not shown as `[Errno 22]` or `()`; a pretrained
summary refuses runs from two checkpoints and says when every run of a model diverged."""

from __future__ import annotations

import pytest
import torch

from stiefel_attention.bench.errors import UserError
from stiefel_attention.bench.grok import run as grok
from stiefel_attention.bench.partial import Checkpoint, checkpoint_path


class _CutOff(Exception):
    """Stands for the end of a session: the run stops mid-way."""


def _cut_at(epoch: int):
    def progress(done, total):
        if done == epoch:
            raise _CutOff

    return progress


def _cut_off_run(cfg: dict, path, key: str = "k", epoch: int = 12) -> None:
    """A run of cfg that saved a checkpoint after every epoch and was cut off after the one of `epoch`."""
    with pytest.raises(_CutOff):
        grok.run(cfg, device="cpu", progress=_cut_at(epoch), checkpoint=Checkpoint(path, key, {}, every_s=0))


@pytest.fixture(scope="module")
def cfg_and_whole():
    """An AdamW run (no start-point check of frames to notice scaled weights) and its record, never cut off."""
    cfg = grok.make_config("smoke", "adamw", 0, "+", epochs=30, eval_every=10)
    return cfg, grok.run(cfg, device="cpu")


def _change_floats_in_place(path, tensor: torch.Tensor) -> None:
    """Overwrite two floats of `tensor`'s bytes inside the checkpoint file: the file still parses."""
    raw = path.read_bytes()
    at = raw.find(tensor.numpy().tobytes())
    assert at > 0
    patched = bytearray(raw)
    patched[at : at + 8] = torch.tensor([0.5, -0.25], dtype=tensor.dtype).numpy().tobytes()
    path.write_bytes(bytes(patched))


@pytest.mark.parametrize("change", ["a few floats", "weights x3"])
def test_a_partial_checkpoint_whose_bytes_changed_is_not_resumed(tmp_path, capsys, cfg_and_whole, change):
    cfg, whole = cfg_and_whole
    path = tmp_path / "run.pt"
    _cut_off_run(cfg, path)
    blob = torch.load(path, weights_only=True)
    weights = blob["state"]["model"]
    if change == "a few floats":
        _change_floats_in_place(path, weights["embed.weight"])
    else:
        for name in weights:
            weights[name].mul_(3)
        torch.save(blob, path)
    capsys.readouterr()
    again = Checkpoint(path, "k", {}, every_s=1e9)
    result = grok.run(cfg, device="cpu", checkpoint=again)
    err = capsys.readouterr().err
    assert "do not match the checksum saved with them" in err and "starting the run afresh" in err, err
    assert again.resumed() is None and result["curves"] == whole["curves"]  # the run as never cut off


def test_the_checksum_covers_what_a_partial_checkpoint_holds_and_survives_saving():
    state = {"model": {"w": torch.randn(3, 2)}, "opts": [{"state": {0: {"step": torch.tensor(3.0)}}, "lr": 1e-3}]}
    state |= {"counters": (0, 0, None, 1.5), "log": {"epoch": [1, 10]}, "rng": torch.get_rng_state(), "x": b"ab"}
    import io

    from stiefel_attention.bench.partial import state_sha256

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert state_sha256(torch.load(buffer, weights_only=True)) == state_sha256(state)
    for changed in (
        {**state, "counters": (0, 0, None, 1.5000000001)},
        {**state, "counters": [0, 0, None, 1.5]},  # a tuple is not a list
        {**state, "log": {"epoch": [1, 11]}},
        {**state, "model": {"w": state["model"]["w"].double()}},
        {**state, "model": {"w": state["model"]["w"].reshape(2, 3)}},
        {**state, "x": b"ac"},
    ):
        assert state_sha256(changed) != state_sha256(state)


@pytest.mark.parametrize(
    "content,said",
    [
        (b"", "it is empty (0 bytes)"),
        ("half", "it is not a complete torch.save archive"),
        ("zeros", "it is not a complete torch.save archive"),
        (b"garbage " * 40, "it is not a complete torch.save archive"),
    ],
    ids=["empty", "truncated", "zero-filled", "garbage"],
)
def test_an_unreadable_partial_checkpoint_is_described(tmp_path, capsys, content, said):
    path = tmp_path / "run.pt"
    Checkpoint(path, "k", {}).save(3, {"w": torch.randn(5000)})
    raw = path.read_bytes()
    if content == "half":
        content = raw[: len(raw) // 2]
    elif content == "zeros":  # a file of the right length whose end never reached the disk
        content = raw[: len(raw) // 2] + bytes(len(raw) - len(raw) // 2)
    path.write_bytes(content)
    assert Checkpoint(path, "k", {}).load() is None
    err = capsys.readouterr().err
    assert f"cannot resume from {path}: {said}" in err and "starting the run afresh" in err, err
    assert "Errno" not in err and "()" not in err


def test_a_partial_checkpoint_that_does_not_fit_the_run_is_deleted_and_the_run_starts_afresh(
    tmp_path, capsys, cfg_and_whole
):
    cfg, whole = cfg_and_whole
    path = tmp_path / "run.pt"
    other = {**cfg, "model": {**cfg["model"], "d_model": 48}}  # as saved by code that built another model
    _cut_off_run(other, path)
    capsys.readouterr()
    again = Checkpoint(path, "k", {}, every_s=1e9)
    result = grok.run(cfg, device="cpu", checkpoint=again)
    err = capsys.readouterr().err
    assert f"the checkpoint {path} (step 12) does not fit this run (RuntimeError: " in err, err
    assert "deleted it, starting the run afresh" in err and not path.exists()
    assert again.resumed() is None and result["curves"] == whole["curves"]


def test_a_run_that_fails_after_resuming_discards_its_checkpoint(tmp_path, capsys):
    """Garbage that loads (a checkpoint saved with NaN weights, its checksum matching) fails the resumed run: the
    checkpoint is deleted and the failure says so, so the next attempt runs afresh instead of failing the same way."""
    from dataclasses import replace

    from stiefel_attention.bench.runner import InlineExecutor, run_cells

    cell = grok.FAMILY.cells("single", "smoke", seeds=1)[1]
    cell = replace(cell, config={**cell.config, "epochs": 30})
    runs = tmp_path / "runs"
    path = checkpoint_path(runs, cell.name, cell.key)
    _cut_off_run(cell.config, path, key=cell.key)
    state = torch.load(path, weights_only=True)["state"]
    for t in state["model"].values():
        t.fill_(float("nan"))
    Checkpoint(path, cell.key, {}).save(12, state)
    capsys.readouterr()
    records, failures = run_cells([cell], runs, InlineExecutor(), progress=False)
    err = capsys.readouterr().err
    assert [c.key for c, _ in failures] == [cell.key] and not records
    assert f"the run failed after resuming from step 12 of {path}" in err, err
    assert "the checkpoint may be what failed it, so it is deleted: the next attempt starts the run afresh" in err
    assert not path.exists()
    records, failures = run_cells([cell], runs, InlineExecutor(), progress=False)
    assert failures == [] and "resumed" not in records[cell.key]
    whole = grok.run(cell.config, device="cpu")
    assert records[cell.key]["curves"] == whole["curves"]


def test_a_run_that_fails_without_resuming_keeps_its_checkpoint(tmp_path):
    cfg = grok.make_config("smoke", "stiefel-adam", 0, "+", epochs=30, eval_every=10)
    path = tmp_path / "run.pt"
    fresh = Checkpoint(path, "k", {}, every_s=0)
    with pytest.raises(_CutOff):
        grok.run(cfg, device="cpu", progress=_cut_at(12), checkpoint=fresh)
    fresh.discard(RuntimeError("any"))  # it did not resume: what it saved is its own progress
    assert path.exists()


# --- the pretrained family ----------------------------------------------------------------------------------


@pytest.fixture
def text(tmp_path):
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler", "in", "mind"]
    lines = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(9)) for i in range(600)]
    path = tmp_path / "text.txt"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_pretrained_checkpoint_whose_bytes_changed_is_remade_never_used(tmp_path, text, capsys):
    pytest.importorskip("transformers")
    from stiefel_attention.bench.pretrained import run as P
    from stiefel_attention.bench.text import cached_text

    corpus, recipe, cpu = cached_text(text), P.pretrain_recipe("smoke", "gpt2"), torch.device("cpu")
    path, info, state = P.checkpoint(recipe, corpus, tmp_path, cpu)
    saved = torch.load(path, weights_only=True)
    for t in saved["state_dict"].values():
        t.mul_(3)
    torch.save(saved, path)  # weights x3, the recorded sha256 kept
    capsys.readouterr()
    again, _, used = P.checkpoint(recipe, corpus, tmp_path, cpu)
    out = capsys.readouterr().out
    assert f"pretrained: remaking {path}: its weights' sha256 is " in out, out
    assert f"not the {P.weights_sha256(state)[:12]} recorded when it was made" in out
    assert again == path and all(torch.equal(state[k], used[k]) for k in state)  # the remade weights, not x3
    assert torch.load(path, weights_only=True)["info"]["weights_sha256"] == P.weights_sha256(state)
    _change_floats_in_place(path, torch.load(path, weights_only=True)["state_dict"]["transformer.wte.weight"])
    _, _, used = P.checkpoint(recipe, corpus, tmp_path, cpu)
    assert "pretrained: remaking" in capsys.readouterr().out
    assert all(torch.equal(state[k], used[k]) for k in state)
    path.write_bytes(b"")
    P.checkpoint(recipe, corpus, tmp_path, cpu)
    assert f"pretrained: remaking {path}: it is empty (0 bytes)" in capsys.readouterr().out


def _record(model: str, arm: str, seed: int, weights: str | None, file: str, diverged: int | None = None) -> dict:
    """A pretrained record as far as the summary reads it."""
    losses = [2.0, 1.8, 1.7] if diverged is None else [2.0, 1.8]
    return {
        "config": {"model": model, "arm": arm, "seed": seed},
        "checkpoint": {"file": f"{model}.pt", "sha256": file} | ({"weights_sha256": weights} if weights else {}),
        "metrics": {
            "pretrained_val_loss": 1.75,
            "converted_val_loss": 2.0,
            "steps_to_recover": None,
            "final_val_loss": losses[-1] if diverged is None else None,
            "diverged_at_step": diverged,
            "max_isometry_error": None if arm == "adamw" else 1e-7,
        },
        "curves": {
            "step": [0, 5, 10][: len(losses)],
            "val_loss": losses,
            "train_loss": [None, 2.1, 1.9][: len(losses)],
        },
    }


def test_a_pretrained_summary_refuses_runs_from_two_checkpoints_naming_both(tmp_path):
    pytest.importorskip("transformers")
    from stiefel_attention.bench.pretrained import run as P

    first = [_record("gpt2", arm, 0, "a" * 64, "f" * 64) for arm in ("adamw", "nearest")]
    second = [_record("gpt2", arm, 1, "b" * 64, "e" * 64) for arm in ("adamw", "nearest")]  # pretrained again
    with pytest.raises(UserError) as err:
        P.summarize(first + second)
    said = str(err.value)
    assert "the gpt2 runs were fine-tuned from 2 different pretrained checkpoints" in said, said
    assert f"weights {'a' * 12} (2 runs, seeds 0); weights {'b' * 12} (2 runs, seeds 1)" in said
    with pytest.raises(UserError, match="2 different pretrained checkpoints"):
        P.write_summary(tmp_path, "main", first + second, "smoke", None)
    assert not (tmp_path / "main" / "summary.json").exists()
    # records made before weights were hashed name the file: the same file is the same checkpoint, another is not
    older = [_record("gpt2", arm, 2, None, "f" * 64) for arm in ("adamw", "nearest")]
    assert P.summarize(first + older)["checkpoints"] == {"gpt2": [f"file {'f' * 12}", f"weights {'a' * 12}"]}
    with pytest.raises(UserError, match=f"file {'d' * 12} \\(2 runs, seeds 2\\); weights {'a' * 12}"):
        P.summarize(first + [_record("gpt2", arm, 2, None, "d" * 64) for arm in ("adamw", "nearest")])


def test_a_pretrained_summary_says_when_every_run_of_a_model_diverged(tmp_path):
    pytest.importorskip("transformers")
    from stiefel_attention.bench.pretrained import run as P

    records = [_record("gpt2", arm, s, "a" * 64, "f" * 64, diverged=7) for arm in ("adamw", "nearest") for s in (0, 1)]
    records += [_record("llama", arm, s, "c" * 64, "e" * 64) for arm in ("adamw", "nearest") for s in (0, 1)]
    summary = P.write_summary(tmp_path, "main", records, "smoke", None)
    text = (tmp_path / "main" / "summary.md").read_text()
    assert "- gpt2: every fine-tuning run diverged (4 of 4): no final loss to compare and no curve to plot." in text
    assert "| gpt2 | adamw | 2 | 1.7500 | 2.0000 | 0/2 | — | — (every run diverged) | 2 | — |" in text
    assert "- llama: every fine-tuning run diverged" not in text and "nan" not in text
    assert summary["plots"] == ["curves.png"] and (tmp_path / "main" / "curves.png").stat().st_size > 0
