"""Pretrained models converted to frames: what `stiefelize` costs a model trained without them, and how fast
fine-tuning with StiefelAdam wins it back.

The command first pretrains a small transformers GPT-2 and a small Llama-style model (rotary embeddings,
SwiGLU, RMSNorm; one key head per query head, as Llama 2 7B has) on tiny Shakespeare with AdamW. Checkpoints
are made by the command, keyed by their recipe (which every fine-tuning cell's config holds, so a record's
key covers the checkpoint it started from), under --checkpoints; never committed. Then every arm fine-tunes
the same checkpoint on the same budget and the same training windows (the seed fixes them; pairing):

- adamw: continue with AdamW, no conversion (the reference);
- nearest: `stiefelize(init="nearest")`, the polar factor of each head's W_Q, W_K, then StiefelAdam;
- nearest-temp: the same with a learnable per-head temperature started at the scalar that keeps each head's
  bilinear form W_Q W_K^T closest to the original (`temperature=True`);
- nearest-cal: the same with each temperature started at the least-squares scalar of the head's logits on a few
  training windows (`calibrate=`), the data-aware version of "keep each head's logit scale";
- svd-temp: `stiefelize(init="svd", temperature=True)`, each head's best frames and scalar for its bilinear form;
- orthonormal: fresh random frames (what the pretrained W_Q, W_K are worth: a conversion that keeps none of it).

Measures (validation loss in nats per character on fixed windows of the validation text): the checkpoint's,
right after conversion (before any step), the steps until the fine-tuned model is back at the checkpoint's
loss, and the final loss. Fine-tuning rates were fixed before any run, not tuned: a tenth of the rates the
`lm` family tuned from scratch at the cpu size (AdamW 1e-2, frames 0.1), the usual fine-tuning reduction.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from ...convert import stiefelize
from ...manifold import isometry_error
from ...nn import frames
from ...optim import NonFiniteGradientError, StiefelAdam, param_groups
from ..errors import UserError
from ..family import Family, check_data
from ..lock import exclusive
from ..partial import file_sha256, why_unreadable
from ..records import Cell, atomic_write
from ..report.document import write_experiment
from ..report.fmt import fmt_ci, fmt_p, fmt_runs, fmt_seeds, open_arms, provisional, save_figure
from ..report.stats import describe, paired_comparison
from ..sequence.family import window_loss
from ..text import DEFAULT_TEXT_SHA256, cached_text, check_windows, fixed_windows, random_windows
from ..training import default_seeds, run_timings, warmup_cosine

_RATES = dict(pretrain_lr=1e-2, lr=1e-3, frame_lr=1e-2, weight_decay=0.1, betas=[0.9, 0.99], max_step=0.1)
PROFILES: dict[str, dict] = {
    "smoke": dict(
        width=32, layers=1, heads=2, context=32, batch=8, pretrain_steps=60, pretrain_warmup=5,
        steps=20, warmup=2, eval_every=5, n_eval=16, **_RATES,
    ),
    # the lm family's cpu size (width 64, 2 layers, 4 heads of 16, context 64) and its 2,400 pretraining steps;
    # fine-tuning is a quarter of that, evaluated every 25 steps to time the recovery
    "cpu": dict(
        width=64, layers=2, heads=4, context=64, batch=32, pretrain_steps=2400, pretrain_warmup=50,
        steps=600, warmup=20, eval_every=25, n_eval=256, **_RATES,
    ),
    # nanoGPT's shakespeare_char size, for a GPU
    "paper": dict(
        width=384, layers=6, heads=6, context=256, batch=64, pretrain_steps=5000, pretrain_warmup=100,
        steps=1000, warmup=50, eval_every=50, n_eval=500, **_RATES,
    ),
}  # fmt: skip
MODELS = ("gpt2", "llama")
# arm: (stiefelize init, or None for no conversion; temperature; temperature calibrated on training windows)
ARMS: dict[str, tuple[str | None, bool, bool]] = {
    "adamw": (None, False, False),
    "nearest": ("nearest", False, False),
    "nearest-temp": ("nearest", True, False),
    "nearest-cal": ("nearest", True, True),
    "svd-temp": ("svd", True, False),
    "orthonormal": ("orthonormal", False, False),
}
CALIBRATION = dict(windows=16, seed=0)  # training windows (never validation text) for the calibrated arm
EXPERIMENTS = ("main",)
DEFAULT_SEEDS = 6  # with 6 pairs an exact two-sided Wilcoxon p can reach 0.031 (with 5, never below 0.0625)
PRETRAIN_SEED = 0
# A fine-tuned model "has recovered" at the first evaluation whose loss is within this of the checkpoint's
# (nats/char): the noise floor of two evaluations of the same model on the same windows is 0, so this only
# absorbs round-off, not sampling noise.
RECOVERY_TOLERANCE = 1e-4


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise UserError(
            "the pretrained family trains transformers models: pip install -e '.[bench]' (which includes transformers)"
        ) from err
    transformers.logging.set_verbosity_error()
    return transformers


def build_model(model: str, prof: dict, vocab: int):
    """A transformers causal LM of the profile's size for a character vocabulary (global RNG: its init)."""
    T = _transformers()
    w, special = prof["width"], dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if model == "gpt2":
        config = T.GPT2Config(
            vocab_size=vocab, n_positions=prof["context"], n_embd=w, n_layer=prof["layers"], n_head=prof["heads"],
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **special,
        )  # fmt: skip
        return T.GPT2LMHeadModel(config)
    if model == "llama":
        config = T.LlamaConfig(
            vocab_size=vocab, hidden_size=w, intermediate_size=8 * ((8 * w // 3 + 7) // 8),
            num_hidden_layers=prof["layers"], num_attention_heads=prof["heads"], num_key_value_heads=prof["heads"],
            max_position_embeddings=prof["context"], tie_word_embeddings=False, **special,
        )  # fmt: skip
        return T.LlamaForCausalLM(config)
    raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")


def pretrain_recipe(profile: str, model: str) -> dict:
    """What a checkpoint is made from: a fine-tuning cell's config holds it, so the record's key covers it."""
    p = PROFILES[profile]
    keys = ("width", "layers", "heads", "context", "batch", "pretrain_steps", "pretrain_warmup", "pretrain_lr")
    return dict(model=model, seed=PRETRAIN_SEED, weight_decay=p["weight_decay"], betas=p["betas"]) | {
        k: p[k] for k in keys
    }


def make_config(profile: str, model: str, arm: str, seed: int) -> dict:
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose one of {', '.join(ARMS)}")
    p = PROFILES[profile]
    init, temperature, calibrated = ARMS[arm]
    return dict(
        profile=profile,
        model=model,
        arm=arm,
        seed=seed,
        init=init,
        temperature=temperature,
        pretrain=pretrain_recipe(profile, model),
        **{k: p[k] for k in ("steps", "warmup", "eval_every", "n_eval", "batch", "context", "lr", "weight_decay")},
        betas=p["betas"],
        frame_lr=p["frame_lr"] if init else None,
        max_step=p["max_step"] if init else None,
    ) | ({"calibration": CALIBRATION} if calibrated else {})


def cells(experiment: str, profile: str, seeds: int) -> list[Cell]:
    if experiment not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {experiment!r}; choose one of {', '.join(EXPERIMENTS)}")
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    return [
        Cell("pretrained", f"{model}-{arm}-s{seed}", make_config(profile, model, arm, seed))
        for seed in range(seeds)
        for model in MODELS
        for arm in ARMS
    ]


def _loss(model, x: torch.Tensor, y: torch.Tensor) -> float:
    """The validation loss of a transformers causal LM on token windows (lm's, through its output's logits)."""
    return window_loss(lambda ids: model(input_ids=ids).logits, x, y)


def _train_step(model, opt, sched, xb, yb) -> float:
    logits = model(input_ids=xb).logits
    loss = F.cross_entropy(logits.flatten(0, 1), yb.flatten())
    value = float(loss.detach())
    if math.isfinite(value):
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return value


def weights_sha256(state: dict[str, torch.Tensor]) -> str:
    """sha256 of a state dict's names, dtypes, shapes and values: the same for the same weights, wherever and
    whenever they were pretrained (the file's own hash also covers the recorded pretraining time)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def checkpoint(recipe: dict, corpus, folder: Path, device: torch.device) -> tuple[Path, dict, dict]:
    """The checkpoint of a recipe on this text: (path, its info, its state dict), pretraining it first if it is
    not there yet."""
    tag = hashlib.sha256(json.dumps({**recipe, "data": corpus.sha256}, sort_keys=True).encode()).hexdigest()[:12]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{recipe['model']}-{tag}.pt"
    with exclusive(folder / f"{path.name}.lock"):  # concurrent runs wait for one pretraining
        if path.exists():
            try:
                saved = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as err:  # a file from an interrupted write, or damaged: made again
                problem = why_unreadable(path, err)
            else:
                problem = _checkpoint_problem(saved, recipe)
                if problem is None:
                    return path, saved["info"], saved["state_dict"]
            print(f"pretrained: remaking {path}: {problem}", flush=True)
        info, state = _pretrain(recipe, corpus, device)
        with atomic_write(path, binary=True) as f:  # a reader never sees half a file
            torch.save({"info": info, "state_dict": state}, f)
    return path, info, state


def _checkpoint_problem(saved, recipe: dict) -> str | None:
    """Why a loaded checkpoint file must not be used for this recipe, or None. Its weights must match the
    weights_sha256 recorded when it was made: a file whose bytes changed but still parse is never used. A file
    made before that was recorded cannot be checked, and says so."""
    try:
        info, state = saved["info"], saved["state_dict"]
        if info["recipe"] != recipe:
            return "it was made from another recipe"
        if "weights_sha256" not in info:
            print(f"pretrained: {recipe['model']} checkpoint made before checkpoints recorded their weights' sha256: "
                  "used unchecked", flush=True)  # fmt: skip
            return None
        found = weights_sha256(state)
    except Exception as err:  # not the dict a checkpoint is
        return f"it is not a pretrained checkpoint ({type(err).__name__}: {err})"
    if found != info["weights_sha256"]:
        return (
            f"its weights' sha256 is {found[:12]}, not the {info['weights_sha256'][:12]} recorded when it was made: "
            "the file was changed or damaged"
        )
    return None


def _pretrain(recipe: dict, corpus, device: torch.device) -> tuple[dict, dict]:
    t0 = time.perf_counter()
    torch.manual_seed(recipe["seed"])
    model = build_model(recipe["model"], recipe, corpus.vocab_size).to(device)
    opt = StiefelAdam(param_groups(model, recipe["weight_decay"]), lr=recipe["pretrain_lr"], betas=recipe["betas"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(recipe["pretrain_steps"], recipe["pretrain_warmup"]))
    order = torch.Generator().manual_seed(1_000_003 * recipe["seed"] + 7)
    for _ in range(recipe["pretrain_steps"]):
        xb, yb = random_windows(corpus.train, recipe["batch"], recipe["context"], order)
        if not math.isfinite(_train_step(model, opt, sched, xb.to(device), yb.to(device))):
            raise RuntimeError(f"pretraining {recipe['model']} diverged; the recipe needs a lower pretrain_lr")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    info = {"recipe": recipe, "data_sha256": corpus.sha256, "train_s": time.perf_counter() - t0}
    return info | {"weights_sha256": weights_sha256(state)}, state


def run(
    cfg: dict, data: str | None = None, device: str | None = None, checkpoints: str | None = None, progress=None
) -> dict:
    t_start = time.perf_counter()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    corpus = cached_text(str(data) if data else None)
    check_data(cfg, DEFAULT_TEXT_SHA256, corpus.sha256, corpus.source)
    path, info, state = checkpoint(cfg["pretrain"], corpus, Path(checkpoints or default_checkpoints()), device)
    torch.manual_seed(cfg["seed"])  # orthonormal frames are drawn from it
    model = build_model(cfg["model"], cfg["pretrain"], corpus.vocab_size)
    model.load_state_dict(state)
    model.to(device).eval()
    x_eval, y_eval = (t.to(device) for t in fixed_windows(corpus.val, cfg["n_eval"], cfg["context"], seed=0))
    pretrained_loss = _loss(model, x_eval, y_eval)
    change = None
    if cfg["init"] is not None:
        calibrate = None
        if "calibration" in cfg:
            cal = torch.Generator().manual_seed(cfg["calibration"]["seed"])
            x_cal, _ = random_windows(corpus.train, cfg["calibration"]["windows"], cfg["context"], cal)
            calibrate = lambda m: m(input_ids=x_cal.to(device))  # noqa: E731
        quiet = logging.getLogger("stiefel_attention")  # its warning on how much nearest changed: recorded below
        level, _ = quiet.level, quiet.setLevel(logging.ERROR)
        try:
            stiefelize(model, init=cfg["init"], temperature=cfg["temperature"], calibrate=calibrate)
        finally:
            quiet.setLevel(level)
        change = max(v["relative_change"] for v in model.stiefelize_report.values())
    converted_loss = _loss(model, x_eval, y_eval)
    groups = param_groups(model, cfg["weight_decay"], frame_lr=cfg["frame_lr"], max_step=cfg["max_step"])
    opt = StiefelAdam(groups, lr=cfg["lr"], betas=cfg["betas"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(cfg["steps"], cfg["warmup"]))
    order = torch.Generator().manual_seed(1_000_003 * cfg["seed"] + 11)
    curves: dict[str, list] = {"step": [0], "val_loss": [converted_loss], "train_loss": [None]}
    running, seen, t_train, diverged = 0.0, 0, 0.0, None
    model.train()
    for step in range(1, cfg["steps"] + 1):
        t0 = time.perf_counter()
        xb, yb = random_windows(corpus.train, cfg["batch"], cfg["context"], order)
        try:
            value = _train_step(model, opt, sched, xb.to(device), yb.to(device))
        except NonFiniteGradientError:
            value = math.nan
        if not math.isfinite(value):
            diverged = step  # an outcome, recorded with its step
            break
        t_train += time.perf_counter() - t0
        running, seen = running + value, seen + 1
        if step % cfg["eval_every"] == 0 or step == cfg["steps"]:
            model.eval()
            curves["step"].append(step)
            curves["val_loss"].append(_loss(model, x_eval, y_eval))
            curves["train_loss"].append(running / seen)
            running, seen = 0.0, 0
            model.train()
        if progress is not None:
            progress(step, cfg["steps"])
    back = [s for s, v in zip(curves["step"], curves["val_loss"]) if v <= pretrained_loss + RECOVERY_TOLERANCE]
    isometry = [float(isometry_error(p)) for _, p in frames(model)]
    return {
        "data_source": corpus.source,
        "data_sha256": corpus.sha256,
        "checkpoint": {
            "file": path.name,
            "sha256": file_sha256(path),
            "weights_sha256": weights_sha256(state),
            "pretrain_s": info["train_s"],
        },
        "metrics": {
            "pretrained_val_loss": pretrained_loss,
            "converted_val_loss": converted_loss,
            "conversion_cost": converted_loss - pretrained_loss,
            "qk_relative_change": change,
            "steps_to_recover": back[0] if back else None,  # None: not back at the checkpoint's loss in budget
            "final_val_loss": curves["val_loss"][-1] if diverged is None else None,
            "best_val_loss": min(curves["val_loss"]),
            "diverged_at_step": diverged,
            "max_isometry_error": max(isometry, default=None),
        },
        "curves": curves,
        "timings": run_timings(t_start, t_train, device),
    }


def default_checkpoints() -> Path:
    base = os.environ.get("STIEFEL_ATTENTION_CACHE") or Path.home() / ".cache" / "stiefel-attention"
    return Path(base) / "pretrained"


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------

COMPARISONS = (  # (arm, baseline): each conversion against continuing with AdamW; the better inits against nearest
    *((arm, "adamw") for arm in ARMS if arm != "adamw"),
    ("nearest-temp", "nearest"),
    ("nearest-cal", "nearest"),
    ("svd-temp", "nearest-temp"),
)


def summarize(records: list[dict]) -> dict:
    by = defaultdict(dict)  # (model, arm) -> seed -> record
    for r in records:
        c = r["config"]
        by[(c["model"], c["arm"])][c["seed"]] = r
    rows, comparisons, checkpoints = [], [], defaultdict(set)
    for (model, arm), recs in sorted(by.items(), key=lambda kv: (kv[0][0], list(ARMS).index(kv[0][1]))):
        ms = [r["metrics"] for r in recs.values()]
        for r in recs.values():
            checkpoints[model].add(_checkpoint_id(r))
        steps = [m["steps_to_recover"] for m in ms]
        rows.append(
            {
                "model": model,
                "arm": arm,
                "n": len(ms),
                "pretrained_val_loss": describe([m["pretrained_val_loss"] for m in ms]),
                "converted_val_loss": describe([m["converted_val_loss"] for m in ms]),
                "recovered": sum(s is not None for s in steps),
                "median_steps_to_recover": _median([s for s in steps if s is not None]),
                "final_val_loss": describe([m["final_val_loss"] for m in ms if m["final_val_loss"] is not None]),
                "diverged": sum(m["diverged_at_step"] is not None for m in ms),
                "max_isometry_error": max((m["max_isometry_error"] or 0.0 for m in ms), default=None),
            }
        )
    for model in checkpoints:
        _one_checkpoint(model, [r for r in records if r["config"]["model"] == model])
    for model in MODELS:
        for arm, base in COMPARISONS:
            a, b = by.get((model, arm), {}), by.get((model, base), {})
            seeds = sorted(s for s in set(a) & set(b) if None not in _finals(a[s], b[s]))
            if not seeds:
                continue
            st = paired_comparison(
                [a[s]["metrics"]["final_val_loss"] for s in seeds], [b[s]["metrics"]["final_val_loss"] for s in seeds]
            )
            comparisons.append({"model": model, "arm": arm, "baseline": base, "seeds": seeds, **st})
    return {
        "n_records": len(records),
        "rows": rows,
        "comparisons": comparisons,
        "checkpoints": {m: sorted(v) for m, v in checkpoints.items()},
        "recovery_tolerance": RECOVERY_TOLERANCE,
    }


def _checkpoint_id(record: dict) -> str:
    """The weights' sha256 ("weights ..."); records made before it was recorded name their file's ("file ...")."""
    c = record["checkpoint"]
    return f"weights {c['weights_sha256'][:12]}" if "weights_sha256" in c else f"file {c['sha256'][:12]}"


def _one_checkpoint(model: str, records: list[dict]) -> None:
    """Refuse runs of one model fine-tuned from different pretrained checkpoints (a second seed's runs made from a
    checkpoint pretrained again, elsewhere or by other code): their arms would be compared from different starting
    points. A record made before weights were hashed names its file's sha256; a later record of the same file is
    the same checkpoint."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[_checkpoint_id(r)].append(r)
    if len(groups) < 2:
        return
    hashed = [r["checkpoint"] for r in records if "weights_sha256" in r["checkpoint"]]
    old_files = {r["checkpoint"]["sha256"] for r in records if "weights_sha256" not in r["checkpoint"]}
    if len({c["weights_sha256"] for c in hashed}) == 1 and old_files <= {c["sha256"] for c in hashed}:
        return
    parts = [
        f"{cid} ({len(rs)} runs, seeds {', '.join(map(str, sorted({r['config']['seed'] for r in rs})))})"
        for cid, rs in sorted(groups.items())
    ]
    raise UserError(
        f"the {model} runs were fine-tuned from {len(groups)} different pretrained checkpoints: {'; '.join(parts)}; "
        "a summary compares arms fine-tuned from one checkpoint: move the records of all but one aside (each names "
        "its checkpoint under 'checkpoint') and run them again from that checkpoint's file in --checkpoints"
    )


def _finals(a: dict, b: dict) -> tuple:
    return a["metrics"]["final_val_loss"], b["metrics"]["final_val_loss"]


def _median(values: list) -> float | None:
    return float(statistics.median(values)) if values else None


def significance(c: dict) -> str:
    """'lower' / 'higher' (arm's final loss vs the baseline's) where the paired 95% CI excludes 0, else 'level'."""
    lo, hi = c["ci95"]
    if lo is None or hi is None or math.isnan(lo):  # fewer than 2 seeds (NaN; null once read back from JSON)
        return "untested"
    return "lower" if hi < 0 else "higher" if lo > 0 else "level"


def verdict(summary: dict, model: str) -> str:
    """One sentence per model, from the computed rows and comparisons only."""
    rows = {r["arm"]: r for r in summary["rows"] if r["model"] == model}
    comps = {(c["arm"], c["baseline"]): c for c in summary["comparisons"] if c["model"] == model}
    if rows and all(r["diverged"] == r["n"] for r in rows.values()):
        n = sum(r["n"] for r in rows.values())
        return f"every fine-tuning run diverged ({n} of {n}): no final loss to compare and no curve to plot"
    if "adamw" not in rows or len(rows) < 2:
        return "not yet measured"
    frame_arms = [a for a in ARMS if a != "adamw" and a in rows]
    best = min(frame_arms, key=lambda a: rows[a]["converted_val_loss"]["mean"])
    cost = rows[best]["converted_val_loss"]["mean"] - rows[best]["pretrained_val_loss"]["mean"]
    parts = [f"the conversion closest to the checkpoint is {best} (+{cost:.3f} nats)"]
    back = [a for a in frame_arms if rows[a]["recovered"]]
    parts.append(
        "no conversion is back at the checkpoint's loss within the budget"
        if not back
        else "back at the checkpoint's loss within the budget: "
        + ", ".join(f"{a} ({rows[a]['recovered']}/{rows[a]['n']})" for a in back)
    )
    ends = [f"{a} {significance(comps[(a, 'adamw')])}" for a in frame_arms if (a, "adamw") in comps]
    parts.append("final loss vs continuing with AdamW: " + ", ".join(ends))
    finals = {a: comps[(a, "adamw")]["mean_diff"] for a in frame_arms if (a, "adamw") in comps}
    if finals:
        best_end = min(finals, key=finals.get)
        parts.append(f"the conversion that ends closest to AdamW is {best_end} ({finals[best_end]:+.3f} nats)")
    return "; ".join(parts)


def markdown(s: dict, profile: str) -> str:
    lines = [
        f"# Pretrained models converted to frames — `main`, profile `{profile}`",
        "",
        f"{fmt_runs(s)}. Each model is pretrained once with AdamW (its checkpoint's sha256 per model: "
        + ", ".join(f"{m} {', '.join(v)}" for m, v in s["checkpoints"].items())
        + "); every arm fine-tunes that checkpoint on the same windows per seed. Losses in nats per character on "
        "fixed validation windows. Recovered: back within "
        f"{s['recovery_tolerance']:g} of the checkpoint's loss at an evaluation of the budget.",
        "",
        "| model | arm | seeds | checkpoint | right after conversion | recovered | median steps to recover | "
        "final (mean ± sd) | diverged | max isometry error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in s["rows"]:
        fin = r["final_val_loss"]
        final = f"{fin['mean']:.4f} ± {fin['std']:.4f}" if fin["n"] else "— (every run diverged)"
        steps = "—" if r["median_steps_to_recover"] is None else f"{r['median_steps_to_recover']:g}"
        iso = "—" if r["arm"] == "adamw" else f"{r['max_isometry_error']:.1e}"
        lines.append(
            f"| {r['model']} | {r['arm']} | {r['n']} | {r['pretrained_val_loss']['mean']:.4f} | "
            f"{r['converted_val_loss']['mean']:.4f} | {r['recovered']}/{r['n']} | {steps} | "
            f"{final} | {r['diverged']} | {iso} |"
        )
    lines += [
        "",
        "Final validation loss, paired by seed (arm − baseline; negative: the arm ends lower). Significant where "
        "the t-based 95% CI excludes 0; the exact Wilcoxon p beside it.",
        "",
        "| model | arm − baseline | mean diff | 95% CI | p (t) | p (Wilcoxon) | lower in | reading |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in s["comparisons"]:
        lines.append(
            f"| {c['model']} | {c['arm']} − {c['baseline']} | {c['mean_diff']:+.4f} | {fmt_ci(c['ci95'], 4)} | "
            f"{fmt_p(c['p_t'])} | {fmt_p(c['p_wilcoxon'])} | {c['losses']}/{c['n_seeds']} | {significance(c)} |"
        )
    lines += ["", *[f"- {m}: {verdict(s, m)}." for m in MODELS if any(r["model"] == m for r in s["rows"])]]
    lines += ["", *(f"![{p}]({p})" for p in s.get("plots", []))]
    return "\n".join(lines) + "\n"


def curves_plot(records: list[dict], out_dir: Path, made: list[str]) -> None:
    """Top: each arm's validation loss (mean over seeds) with the checkpoint's. Bottom: each conversion's gap to
    the adamw arm, paired by seed (mean and the range over seeds), where the last steps can be read."""
    import matplotlib.pyplot as plt

    models = [m for m in MODELS if any(r["config"]["model"] == m for r in records)]
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 8), squeeze=False)
    for col, model in enumerate(models):
        top, bottom = axes[0][col], axes[1][col]
        recs = [r for r in records if r["config"]["model"] == model and r["metrics"]["diverged_at_step"] is None]
        if not recs:  # no finished curve to draw: the panel says why
            top.text(0.5, 0.5, f"every {model} run diverged", ha="center", va="center", transform=top.transAxes)
            top.set(title=model)
            bottom.set_axis_off()
            continue
        by_arm = {a: {r["config"]["seed"]: r for r in recs if r["config"]["arm"] == a} for a in ARMS}
        base = by_arm["adamw"]
        for i, (arm, mine) in enumerate(by_arm.items()):
            if not mine:
                continue
            steps = next(iter(mine.values()))["curves"]["step"]
            curves = [r["curves"]["val_loss"] for r in mine.values()]
            mean = [sum(c[j] for c in curves) / len(curves) for j in range(len(steps))]
            top.plot(steps, mean, color=f"C{i}", label=f"{arm} ({fmt_seeds(len(curves))})")
            paired = [s for s in mine if s in base]
            if arm == "adamw" or not paired:
                continue
            gaps = [
                [a - b for a, b in zip(mine[s]["curves"]["val_loss"], base[s]["curves"]["val_loss"])] for s in paired
            ]
            mean = [sum(g[j] for g in gaps) / len(gaps) for j in range(len(steps))]
            bottom.plot(steps, mean, color=f"C{i}", label=arm)
            low = [min(g[j] for g in gaps) for j in range(len(steps))]
            high = [max(g[j] for g in gaps) for j in range(len(steps))]
            bottom.fill_between(steps, low, high, color=f"C{i}", alpha=0.15)
        top.axhline(recs[0]["metrics"]["pretrained_val_loss"], color="k", ls="--", lw=0.8, label="checkpoint")
        top.set_yscale("log")
        top.set(title=model, xlabel="fine-tuning step", ylabel="validation loss (nats/char, mean over seeds)")
        top.legend(fontsize=8)
        bottom.axhline(0.0, color="k", lw=0.8)
        bottom.set_yscale("symlog", linthresh=0.01)
        bottom.set(xlabel="fine-tuning step", ylabel="loss − adamw's, same seed (nats/char; band: range)")
        bottom.legend(fontsize=8)
    save_figure(fig, out_dir, "curves.png", made)


def write_summary(out_dir, experiment: str, records: list[dict], profile: str, plan) -> dict:
    def plots(summary: dict, exp_dir: Path) -> list[str]:
        made: list[str] = []
        curves_plot(records, exp_dir, made)
        return made

    return write_experiment(out_dir, experiment, summarize(records), plots, markdown, profile, plan)


class PretrainedFamily(Family):
    name = "pretrained"
    title = "pretrained transformers models converted to frames (tiny Shakespeare)"
    help = "pretrain small transformers GPT-2 and Llama models, convert them with stiefelize, fine-tune, compare"
    profiles = PROFILES
    experiments = EXPERIMENTS
    experiment_help = {
        "main": "what converting a pretrained GPT-2 / Llama to frames costs, and how fast fine-tuning wins it back",
    }
    claimed = ("main",)
    default_data_sha256 = DEFAULT_TEXT_SHA256

    def add_arguments(self, parser) -> None:
        self.add_reproduce_arguments(parser)
        parser.add_argument("--text", dest="text", default=None, help="UTF-8 text corpus (default: as lm's)")
        parser.add_argument("--data", dest="text", default=None, help=argparse.SUPPRESS)  # the old name of --text

    def add_reproduce_arguments(self, parser) -> None:  # the text comes from lm's --text there
        parser.add_argument(
            "--checkpoints",
            default=None,
            help="folder for the pretrained checkpoints the pretrained family makes and reuses (default: "
            "$STIEFEL_ATTENTION_CACHE/pretrained, else ~/.cache/stiefel-attention/pretrained)",
        )

    def cells(self, experiment: str, profile: str, seeds: int | None = None, **options) -> list[Cell]:
        return cells(
            experiment, profile, default_seeds({"main": DEFAULT_SEEDS}, experiment, profile) if seeds is None else seeds
        )

    def run_options(self, args) -> dict:
        _transformers()
        corpus = cached_text(getattr(args, "text", None))
        if getattr(args, "profile", None) in PROFILES:
            check_windows(corpus, PROFILES[args.profile]["context"])
        folder = Path(getattr(args, "checkpoints", None) or default_checkpoints())
        return {"data": corpus.source, "checkpoints": str(folder)}

    def data_sha256(self, run_options: dict) -> str:
        return cached_text(run_options["data"]).sha256

    def describe(self, run_options: dict) -> str:
        return f"text {run_options['data']}, checkpoints in {run_options['checkpoints']}"

    def run(self, config: dict, progress=None, **options) -> dict:
        return run(config, progress=progress, **options)

    def write_summary(self, out_dir, experiment, records, profile, plan, by_key) -> dict:
        return write_summary(out_dir, experiment, records, profile, plan)

    def claim_rows(self, experiment: str, summary: dict, link: str, profile: str) -> list[tuple[str, ...]]:
        rows = []
        for model in MODELS:
            mine = {r["arm"]: r for r in summary["rows"] if r["model"] == model}
            if not mine:
                continue
            conv = ", ".join(
                f"{a} +{r['converted_val_loss']['mean'] - r['pretrained_val_loss']['mean']:.3f}"
                for a, r in mine.items()
                if a != "adamw"
            )
            finals = ", ".join(
                f"{c['arm']} {c['mean_diff']:+.3f} {fmt_ci(c['ci95'], 3)} p_W={fmt_p(c['p_wilcoxon'])}"
                for c in summary["comparisons"]
                if c["model"] == model and c["baseline"] == "adamw"
            )
            rows.append(
                (
                    link,
                    profile,
                    f"(not the paper's; issue 27) a pretrained {model}: what converting W_Q, W_K to frames costs, "
                    "and fine-tuning with StiefelAdam against continuing with AdamW",
                    f"loss right after conversion, above the checkpoint's: {conv}; final loss − adamw: {finals}",
                    provisional(verdict(summary, model), open_arms(summary, ARMS), decided=True),
                )
            )
        return rows


FAMILY = PretrainedFamily()
