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
import copy
import hashlib
import math
import time

import torch
import torch.nn.functional as F

from ...nn import qk_clip, reset_logit_stats
from ...optim import NonFiniteGradientError
from ..arms import BOUNDED_ARMS, arm_spec
from ..errors import NotReady
from ..family import check_data
from ..models import CharGPT
from ..records import Cell
from ..sequence.family import SequenceFamily, window_loss
from ..text import DEFAULT_TEXT_SHA256, cached_text, check_windows, fixed_windows, random_windows
from ..training import (
    SEQUENCE_ARMS,
    Trainer,
    log_mechanism,
    tuned_rates,
)
from .report import stability_answer, write_lm_report

_NANOGPT = dict(lr=1e-3, frame_lr=1e-2, weight_decay=0.1, betas=[0.9, 0.99], max_step=0.1, sgd_frame_lr=1.0)
PROFILES: dict[str, dict] = {
    "smoke": dict(
        model=dict(d_model=32, n_layers=1, n_heads=2, head_dim=16, mlp_ratio=2),
        context=32,
        batch=8,
        steps=40,
        eval_every=10,
        n_eval=32,
        warmup=5,
        tuned={},
        qk_clip_tau=4.0,
        **_NANOGPT,
    ),
    # About 3 min of one core per run. The number of steps is sized so that trained Q/K beat frozen ones (the
    # sensitivity line of REPORT.md), chosen on the sweep split as commit c009f98 describes; results/lm/main
    # measures that sensitivity at this size.
    "cpu": dict(
        model=dict(d_model=64, n_layers=2, n_heads=4, head_dim=16, mlp_ratio=4),
        context=64,
        batch=32,
        steps=2400,
        eval_every=200,
        n_eval=256,
        warmup=50,
        # the lr-sweep's choices (results/lm/lr-sweep, 2 seeds, scored on held-out training text); the frame
        # arms' other parameters train at adamw's lr (training.anchor_lr)
        tuned={
            "adamw": {"lr": 1e-2},
            "adamw-orthoinit": {"lr": 1e-2},
            "adamw-qk-nodecay": {"lr": 1e-2},
            "qk-norm": {"lr": 1e-2},
            "frozen": {"lr": 3e-2},
            "stiefel-sgd": {"frame_lr": 3.0},
            "stiefel-adam": {"frame_lr": 0.1},
            "orthogonal-param": {"frame_lr": 1e-2},
            "muon": {"frame_lr": 3e-2},
            "stiefel-adam-temp": {"frame_lr": 0.3},
            "adamw-bounded": {"lr": 1e-2},
            "stiefel-adam-bounded": {"frame_lr": 0.3},
            "stiefel-adam-bounded-temp": {"frame_lr": 0.3},
        },
        # lr-stability's QK-Clip threshold, fixed before its runs: above the largest attention logit of every
        # adamw run of `main` (m = 1; 12 seeds, largest head at the end 32.5-44.7), so that it binds only where
        # logits grow past normal training, as QK-Clip is used
        qk_clip_tau=50.0,
        **_NANOGPT,
    ),
    # nanoGPT's shakespeare_char size (6 layers, 384 wide, 6 heads, context 256), for a GPU; no dropout here
    "paper": dict(
        model=dict(d_model=384, n_layers=6, n_heads=6, head_dim=64, mlp_ratio=4),
        context=256,
        batch=64,
        steps=5000,
        eval_every=250,
        n_eval=500,
        warmup=100,
        tuned={},
        qk_clip_tau=None,  # fixed from this profile's adamw runs of `main` before its lr-stability runs
        **_NANOGPT,
    ),
}
MAIN_ARMS = SEQUENCE_ARMS + BOUNDED_ARMS
SCALING_STEPS = (0.5, 1.0, 2.0)  # training steps, as multiples of the profile's
# lr-stability (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training instabilities"):
# every rate an arm has (its tuned rates) times m; adamw also with QK-Clip at the profile's qk_clip_tau. At m = 1
# the plain arms' cells are main's.
STABILITY_RUNS = (
    ("adamw", False),
    ("qk-norm", False),
    ("adamw", True),
    ("stiefel-adam", False),
    ("stiefel-adam-temp", False),
    ("frozen", False),
    *((arm, False) for arm in BOUNDED_ARMS),
)
LR_MULTIPLIERS = {"smoke": (1.0, 64.0), "cpu": (0.25, 1.0, 4.0, 16.0, 64.0), "paper": (0.25, 1.0, 4.0, 16.0, 64.0)}
EXPERIMENTS = ("main", "lr-sweep", "scaling", "lr-stability", "factorial")
DEFAULT_SEEDS = {"main": 12, "lr-sweep": 2, "scaling": 6, "lr-stability": 3, "factorial": 12}
# Values an arm's sweep adds past the edge of its grid (training.LR_GRID, FRAME_LR_GRID), entered when the
# best value sat on that edge: results/lm/lr-sweep/summary.md flags such arms.
SWEEP_EXTENSIONS: dict[str, dict[str, tuple[float, ...]]] = {
    "cpu": {
        **{arm: (3e-2,) for arm in ("adamw", "adamw-orthoinit", "adamw-qk-nodecay", "qk-norm", "adamw-bounded")},
        "frozen": (3e-2, 1e-1),
        "muon": (3e-2, 1e-1),
        "orthogonal-param": (3e-2,),
        "stiefel-adam": (0.3,),
        "stiefel-adam-temp": (0.3, 1.0),
        "stiefel-adam-bounded": (1.0,),
        "stiefel-adam-bounded-temp": (1.0,),
    },
}
SAMPLE_CHARS = 300


def make_config(profile: str, arm: str, seed: int, split: str = "val", **overrides) -> dict:
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    spec = arm_spec(arm)
    prof = copy.deepcopy(PROFILES[profile])
    rates = tuned_rates("lm", PROFILES, profile, arm, "val", split)
    cfg = dict(
        profile=profile,
        arm=arm,
        seed=seed,
        split=split,
        model=prof["model"],
        context=prof["context"],
        batch=prof["batch"],
        steps=prof["steps"],
        eval_every=prof["eval_every"],
        n_eval=prof["n_eval"],
        warmup=prof["warmup"],
        **rates,
        weight_decay=prof["weight_decay"],
        betas=prof["betas"],
        max_step=prof["max_step"] if spec.trust_region else None,
    )
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}")
    cfg.update(overrides)
    return cfg


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
        value = float(loss.detach())
        if not math.isfinite(value):
            diverged = step
            break
        try:
            trainer.step(loss)
        except NonFiniteGradientError:
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
        "timings": {
            "train_s": t_train,
            "total_s": time.perf_counter() - t_start,
            "device": str(device),
            "threads": torch.get_num_threads(),
        },
    }


class LMFamily(SequenceFamily):
    name = "lm"
    title = "character-level LM (tiny Shakespeare)"
    help = "character-level language modelling on tiny Shakespeare (or any UTF-8 text)"
    profiles = PROFILES
    experiments = EXPERIMENTS
    experiment_help = {
        "factorial": "geometry x optimizer on W_Q, W_K (12 cells, 2 variants), 12 paired seeds: which factor matters",
        "main": "every arm at its tuned rates, 12 paired seeds: validation loss in nats per character",
        "lr-sweep": "each arm's learning rates, scored on held-out training text, in two stages",
        "scaling": "the stiefel-adam lead against the training budget (steps)",
        "lr-stability": "every arm's rates times 1/4 to 64: sensitivity and the largest attention logit",
    }
    reproduce_order = ("lr-sweep", "main", "scaling", "lr-stability", "factorial")
    controls_experiment = "main"
    mechanism_experiment = "lr-stability"
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
