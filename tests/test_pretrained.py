"""The pretrained family: checkpoints made once per recipe and shared by every arm, conversions recorded from the
step before any training, records keyed by the recipe, the summary and its plot. Smoke size, generated nowhere:
the text is tiny Shakespeare when present, else a generated text."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("transformers")

from helpers import smoke_args  # noqa: E402
from stiefel_attention.bench import cli  # noqa: E402
from stiefel_attention.bench.errors import UserError  # noqa: E402
from stiefel_attention.bench.pretrained import run as P  # noqa: E402
from stiefel_attention.bench.text import cached_text  # noqa: E402


@pytest.fixture
def text(tmp_path):
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler", "in", "mind"]
    lines = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(9)) for i in range(600)]
    path = tmp_path / "text.txt"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _records(out):
    return [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]


def test_smoke_experiment_shares_one_checkpoint_per_model_and_records_the_conversion(tmp_path, text, capsys):
    out, ck = tmp_path / "out", tmp_path / "ck"
    argv = smoke_args("pretrained", "main", out, "--seeds", "1", "--text", text, "--checkpoints", str(ck))
    assert cli.main(argv) == 0
    recs = _records(out)
    assert len(recs) == len(P.MODELS) * len(P.ARMS)
    made = sorted(ck.glob("*.pt"))
    assert [p.name.split("-")[0] for p in made] == sorted(P.MODELS)
    for model in P.MODELS:
        mine = {r["config"]["arm"]: r for r in recs if r["config"]["model"] == model}
        assert len({r["checkpoint"]["weights_sha256"] for r in mine.values()}) == 1
        assert len({r["metrics"]["pretrained_val_loss"] for r in mine.values()}) == 1
        plain = mine["adamw"]["metrics"]
        assert plain["converted_val_loss"] == plain["pretrained_val_loss"] and plain["steps_to_recover"] == 0
        assert plain["max_isometry_error"] is None and mine["adamw"]["config"]["frame_lr"] is None
        for arm in ("nearest", "nearest-temp", "nearest-cal", "svd-temp", "orthonormal"):
            m = mine[arm]["metrics"]
            assert m["max_isometry_error"] < 1e-5 and m["qk_relative_change"] > 0
            assert m["converted_val_loss"] == mine[arm]["curves"]["val_loss"][0]
        costs = {arm: mine[arm]["metrics"]["conversion_cost"] for arm in ("nearest", "nearest-temp", "nearest-cal")}
        assert len(set(costs.values())) == 3, costs  # the temperatures change the converted function
    assert "calibration" in mine["nearest-cal"]["config"] and "calibration" not in mine["nearest-temp"]["config"]
    summary = json.loads((out / "main" / "summary.json").read_text())
    assert summary["plots"] == ["curves.png"] and (out / "main" / "curves.png").stat().st_size > 0
    assert {(c["arm"], c["baseline"]) for c in summary["comparisons"]} >= {("nearest", "adamw")}
    rows = P.FAMILY.claim_rows("main", summary, "link", "smoke")  # as REPORT reads it back: one seed, no CI
    assert len(rows) == len(P.MODELS) and all("untested" in row[4] for row in rows)
    summary["planned_by_arm"] = {"adamw": [1, 3], "nearest": [1, 1]}  # a row waits for every planned run
    assert all(r[4].startswith("so far (adamw 1/3 runs): ") for r in P.FAMILY.claim_rows("main", summary, "l", "smoke"))
    # the same command again runs nothing and pretrains nothing
    stamps = [p.stat().st_mtime_ns for p in made]
    capsys.readouterr()
    assert cli.main(argv) == 0
    assert [p.stat().st_mtime_ns for p in made] == stamps and len(_records(out)) == len(recs)


def test_a_records_key_covers_the_pretraining_recipe(monkeypatch):
    before = {c.name: c.key for c in P.cells("main", "smoke", 1)}
    monkeypatch.setitem(P.PROFILES["smoke"], "pretrain_steps", 61)
    after = {c.name: c.key for c in P.cells("main", "smoke", 1)}
    assert before.keys() == after.keys() and all(before[n] != after[n] for n in before)


def test_a_damaged_checkpoint_is_made_again(tmp_path, text, capsys):
    import torch

    corpus = cached_text(text)
    recipe = P.pretrain_recipe("smoke", "gpt2")
    path, info, state = P.checkpoint(recipe, corpus, tmp_path, torch.device("cpu"))
    assert all(
        torch.equal(t, u) for t, u in zip(state.values(), torch.load(path, weights_only=True)["state_dict"].values())
    )
    path.write_bytes(b"not a checkpoint")
    again, _, _ = P.checkpoint(recipe, corpus, tmp_path, torch.device("cpu"))
    assert again == path and "remaking" in capsys.readouterr().out
    remade = torch.load(path, weights_only=True)["state_dict"]
    assert all(torch.equal(state[k], remade[k]) for k in state)  # pretraining is deterministic
    assert P.weights_sha256(state) == P.weights_sha256(remade)  # the weights' id, unlike the file's (its timing)
    remade[next(iter(remade))].view(-1)[0] += 1
    assert P.weights_sha256(state) != P.weights_sha256(remade)


def test_without_transformers_the_family_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(UserError, match=r"pip install -e '\.\[bench\]' \(which includes transformers\)"):
        P._transformers()
