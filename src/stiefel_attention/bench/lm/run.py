"""Character-level language modelling on tiny Shakespeare: a testbed where attention has to be learned.

`run(config) -> result` trains a CharGPT on random windows of the training text and measures the
validation loss in nats per character on a fixed, seeded set of validation windows (the same in
every run), with curves over training, the mechanism metrics, and a few hundred characters sampled
from the trained model at a fixed seed. Pairing: the seed fixes the model init (global RNG while the
model is built) and, through its own generator, the training windows, identically in every arm.

Learning rates come from `lr-sweep`, scored on held-out training text (the last 10% of the training
part, never the validation windows of the result), in the two stages of `training.sweep_points`.
Chosen rates are entered in PROFILES[...]["tuned"].
"""

from __future__ import annotations

import argparse
import hashlib
import math
import time

import torch
import torch.nn.functional as F

from ...nn import qk_clip, reset_logit_stats
from ..arms import FACTORIAL_ARMS, FACTORIAL_HELP
from ..errors import NotReady
from ..family import check_data
from ..models import CharGPT
from ..records import Cell
from ..sequence.family import SequenceFamily, sequence_config, window_loss
from ..text import DEFAULT_TEXT_SHA256, cached_text, check_windows, fixed_windows, random_windows
from ..training import Trainer, log_mechanism, run_timings
from .config import (
    DEFAULT_SEEDS,
    EXPERIMENTS,
    LR_MULTIPLIERS,
    MAIN_ARMS,
    PROFILES,
    SAMPLE_CHARS,
    SCALING_STEPS,
    STABILITY_RUNS,
    SWEEP_EXTENSIONS,
)
from .report import stability_answer, write_lm_report

_SETTINGS = ("context", "batch", "steps", "eval_every", "n_eval", "warmup")  # a config's, after the model


def make_config(profile: str, arm: str, seed: int, split: str = "val", **overrides) -> dict:
    return sequence_config("lm", PROFILES, profile, arm, seed, split, "val", _SETTINGS, overrides)


def stability_config(profile: str, arm: str, seed: int, multiplier: float, clip: bool) -> dict:
    """main's config of arm with every rate times multiplier (recorded as lr_multiplier unless it is 1) and,
    with clip, QK-Clip at the profile's threshold (qk_clip)."""
    cfg = make_config(profile, arm, seed)
    if multiplier != 1.0:
        cfg.update(lr=cfg["lr"] * multiplier, frame_lr=cfg["frame_lr"] * multiplier, lr_multiplier=multiplier)
    if clip:
        tau = PROFILES[profile]["qk_clip_tau"]
        if tau is None:
            raise NotReady(f"lm profile {profile!r} has no qk_clip_tau yet (fixed from its adamw runs of main)")
        cfg["qk_clip"] = tau
    return cfg


def _cell(cfg: dict) -> Cell:
    name = f"{cfg['arm']}-s{cfg['seed']}"
    if cfg["split"] == "sweep":
        name += f"-sweep-lr{cfg['lr']:g}-flr{cfg['frame_lr']:g}"
    if cfg["steps"] != PROFILES[cfg["profile"]]["steps"]:
        name += f"-steps{cfg['steps']}"
    if "lr_multiplier" in cfg:
        name += f"-lrx{cfg['lr_multiplier']:g}"
    if "qk_clip" in cfg:
        name += f"-clip{cfg['qk_clip']:g}"
    return Cell("lm", name, cfg)


def cells(experiment: str, profile: str, seeds: int) -> list[Cell]:
    return FAMILY.cells(experiment, profile, seeds)


def run(cfg: dict, data: str | None = None, device: str | None = None, progress=None) -> dict:
    t_start = time.perf_counter()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    corpus = cached_text(str(data) if data else None)
    check_data(cfg, DEFAULT_TEXT_SHA256, corpus.sha256, corpus.source)
    if cfg["split"] == "sweep":  # held-out training text: the last 10% of the training part
        cut = int(0.9 * len(corpus.train))
        train_ids, eval_ids = corpus.train[:cut], corpus.train[cut:]
    elif cfg["split"] == "val":
        train_ids, eval_ids = corpus.train, corpus.val
    else:
        raise ValueError(f"split must be 'val' or 'sweep', got {cfg['split']!r}")
    x_eval, y_eval = (t.to(device) for t in fixed_windows(eval_ids, cfg["n_eval"], cfg["context"], seed=0))
    probe = x_eval[:16]  # the fixed batch of the mechanism metrics
    tau = cfg.get("qk_clip")
    trainer = Trainer(
        cfg,
        lambda **kw: CharGPT(corpus.vocab_size, cfg["context"], **cfg["model"], **kw, track_logits=tau is not None),
        device,
        cfg["steps"],
        cfg["warmup"],
    )
    model = trainer.model
    order = torch.Generator().manual_seed(1_000_003 * cfg["seed"] + 2)
    order_hash = hashlib.sha256()
    curves: dict[str, list] = {"step": [], "train_loss": [], "val_loss": [], "max_output_logit": []}
    mechanism: dict[str, list] = {}
    running, seen, t_train = 0.0, 0, 0.0
    diverged, clip_steps, clip_heads = None, 0, 0  # a diverged run is an outcome, recorded with its step
    for step in range(1, cfg["steps"] + 1):
        t0 = time.perf_counter()
        xb, yb = random_windows(train_ids, cfg["batch"], cfg["context"], order)
        order_hash.update(xb[:, 0].numpy().tobytes())
        if tau is not None:
            reset_logit_stats(model)  # the clip reads this step's forward only
        logits = model(xb.to(device))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yb.to(device).reshape(-1))
        value = trainer.step_unless_blown_up(loss)
        if value is None:
            diverged = step
            break
        if tau is not None:
            clipped = qk_clip(model, tau)
            clip_steps, clip_heads = clip_steps + (clipped > 0), clip_heads + clipped
        t_train += time.perf_counter() - t0
        running, seen = running + value, seen + 1
        if step % cfg["eval_every"] == 0 or step == cfg["steps"]:
            model.eval()
            val_loss = window_loss(model, x_eval, y_eval)
            if not math.isfinite(val_loss):
                diverged = step
                break
            curves["step"].append(step)
            curves["train_loss"].append(running / seen)
            curves["val_loss"].append(val_loss)
            with torch.no_grad():
                curves["max_output_logit"].append(float(model(probe).abs().max()))
            log_mechanism(mechanism, model, lambda: model(probe))
            model.train()
            running, seen = 0.0, 0
        if progress is not None:
            progress(step, cfg["steps"])
    model.eval()
    sample = ""
    if diverged is None:
        prompt = corpus.val[:1].to(device)
        generated = model.sample(prompt, SAMPLE_CHARS, torch.Generator().manual_seed(0))
        sample = corpus.decode(prompt) + corpus.decode(generated)
    return {
        "data_source": corpus.source,
        "data_sha256": corpus.sha256,
        "pairing": {"init_sha256": trainer.fingerprint, "order_sha256": order_hash.hexdigest()[:16]},
        "metrics": {
            "final_val_loss": curves["val_loss"][-1] if diverged is None else None,
            "best_val_loss": min(curves["val_loss"], default=None),
            "final_train_loss": curves["train_loss"][-1] if curves["train_loss"] and diverged is None else None,
            "eval_split": cfg["split"],
            "diverged_at_step": diverged,  # None: trained to the end with finite losses
            "uniform_loss": math.log(corpus.vocab_size),  # a uniform prediction's loss: what a diverged run counts
            **({"qk_clip_steps": clip_steps, "qk_clip_heads": clip_heads} if tau is not None else {}),
        },
        "curves": {**curves, "mechanism": mechanism},
        "sample": sample,
        "timings": run_timings(t_start, t_train, device),
    }


class LMFamily(SequenceFamily):
    name = "lm"
    title = "character-level LM (tiny Shakespeare)"
    help = "character-level language modelling on tiny Shakespeare (or any UTF-8 text)"
    profiles = PROFILES
    experiments = EXPERIMENTS
    experiment_help = {
        "factorial": FACTORIAL_HELP,
        "main": "every arm at its tuned rates, 12 paired seeds: validation loss in nats per character",
        "lr-sweep": "each arm's learning rates, scored on held-out training text, in two stages",
        "scaling": "the stiefel-adam lead against the training budget (steps)",
        "lr-stability": "every arm's rates times 1/4 to 64: sensitivity and the largest attention logit",
        "factorial-stability": "the factorial's cells at lr-stability's multipliers, 3 seeds: which factor carries "
        "the learning-rate sensitivity",
    }
    reproduce_order = ("lr-sweep", "main", "scaling", "lr-stability", "factorial", "factorial-stability")
    controls_experiment = "main"
    mechanism_experiment = "lr-stability"
    factorial_experiments = ("factorial", "factorial-stability")
    default_data_sha256 = DEFAULT_TEXT_SHA256
    main_arms = MAIN_ARMS
    default_seeds = DEFAULT_SEEDS
    sweep_extensions = SWEEP_EXTENSIONS
    sweep_split = "sweep"
    config = staticmethod(make_config)
    cell = staticmethod(_cell)

    def add_arguments(self, parser) -> None:
        self.add_reproduce_arguments(parser)
        parser.add_argument("--data", dest="text", default=None, help=argparse.SUPPRESS)  # the old name of --text

    def add_reproduce_arguments(self, parser) -> None:
        parser.add_argument(
            "--text",
            dest="text",
            default=None,
            help="UTF-8 text corpus (default: $STIEFEL_ATTENTION_TEXT, "
            "data/tinyshakespeare.txt or ../shared/datasets/tinyshakespeare.txt)",
        )

    def own_cells(self, experiment: str, profile: str, seeds: range) -> list[Cell] | None:
        if experiment == "lr-stability":
            return [
                _cell(stability_config(profile, arm, s, m, clip))
                for s in seeds
                for m in LR_MULTIPLIERS[profile]
                for arm, clip in STABILITY_RUNS
            ]
        if experiment == "factorial-stability":  # at m = 1 the cells are factorial's; shared arms, lr-stability's
            return [
                _cell(stability_config(profile, arm, s, m, False))
                for s in seeds
                for m in LR_MULTIPLIERS[profile]
                for arm in FACTORIAL_ARMS
            ]
        if experiment == "scaling":
            steps = PROFILES[profile]["steps"]
            return [
                _cell(make_config(profile, a, s, steps=round(f * steps)))
                for f in SCALING_STEPS
                for s in seeds
                for a in ("adamw", "stiefel-adam")
            ]
        return None

    def run_options(self, args) -> dict:
        corpus = cached_text(getattr(args, "text", None))
        if getattr(args, "profile", None) in PROFILES:  # too short a text fails here, not in every run
            check_windows(corpus, PROFILES[args.profile]["context"])
        return {"data": corpus.source}

    def data_sha256(self, run_options: dict) -> str:
        return cached_text(run_options["data"]).sha256

    def describe(self, run_options: dict) -> str:
        return f"text {run_options['data']}"

    def run(self, config: dict, progress=None, **options) -> dict:
        return run(config, progress=progress, **options)

    def mechanism_answer(self, experiment, summary):
        return stability_answer(summary, self.title) if experiment == self.mechanism_experiment else None

    def write_summary(self, out_dir, experiment, records, profile, plan, by_key) -> dict:
        return write_lm_report(out_dir, experiment, records, profile, plan)


FAMILY = LMFamily()
