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

import copy
import hashlib
import math
import time
from functools import lru_cache

import torch
import torch.nn.functional as F

from .arms import arm_spec
from .family import Family, check_data
from .models import CharGPT
from .records import Cell
from .seq_report import write_lm_report
from .text import DEFAULT_TEXT_SHA256, check_windows, fixed_windows, load_text, random_windows
from .training import (
    SEQUENCE_ARMS,
    Trainer,
    anchor_lr,
    default_seeds,
    log_mechanism,
    sweep_note,
    sweep_points,
    tuned_rates,
)

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
        },
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
        **_NANOGPT,
    ),
}
MAIN_ARMS = SEQUENCE_ARMS
SCALING_STEPS = (0.5, 1.0, 2.0)  # training steps, as multiples of the profile's
EXPERIMENTS = ("main", "lr-sweep", "scaling")
DEFAULT_SEEDS = {"main": 12, "lr-sweep": 2, "scaling": 6}
# Values an arm's sweep adds past the edge of its grid (training.LR_GRID, FRAME_LR_GRID), entered when the
# best value sat on that edge: results/lm/lr-sweep/summary.md flags such arms.
SWEEP_EXTENSIONS: dict[str, dict[str, tuple[float, ...]]] = {
    "cpu": {
        **{arm: (3e-2,) for arm in ("adamw", "adamw-orthoinit", "adamw-qk-nodecay", "qk-norm")},
        "frozen": (3e-2, 1e-1),
        "muon": (3e-2, 1e-1),
        "orthogonal-param": (3e-2,),
        "stiefel-adam": (0.3,),
        "stiefel-adam-temp": (0.3, 1.0),
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


def _cell(cfg: dict) -> Cell:
    name = f"{cfg['arm']}-s{cfg['seed']}"
    if cfg["split"] == "sweep":
        name += f"-sweep-lr{cfg['lr']:g}-flr{cfg['frame_lr']:g}"
    if cfg["steps"] != PROFILES[cfg["profile"]]["steps"]:
        name += f"-steps{cfg['steps']}"
    return Cell("lm", name, cfg)


def cells(experiment: str, profile: str, seeds: int) -> list[Cell]:
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    S = range(seeds)
    if experiment == "main":
        return [_cell(make_config(profile, a, s)) for s in S for a in MAIN_ARMS]
    if experiment == "lr-sweep":
        return [
            _cell(make_config(profile, arm, s, "sweep", **rates))
            for arm, rates in sweep_points(profile, SWEEP_EXTENSIONS.get(profile), anchor_lr(PROFILES, profile))
            for s in S
        ]
    if experiment == "scaling":
        steps = PROFILES[profile]["steps"]
        return [
            _cell(make_config(profile, a, s, steps=round(f * steps)))
            for f in SCALING_STEPS
            for s in S
            for a in ("adamw", "stiefel-adam")
        ]
    raise ValueError(f"unknown experiment {experiment!r}; choose one of {', '.join(EXPERIMENTS)}")


@lru_cache(maxsize=2)
def cached_text(data: str | None):
    return load_text(data)


@torch.no_grad()
def _loss(model, x: torch.Tensor, y: torch.Tensor, batch: int = 64) -> float:
    """Mean cross-entropy over every position of the windows, in nats per character."""
    total = 0.0
    for i in range(0, len(x), batch):
        logits = model(x[i : i + batch])
        total += float(
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[i : i + batch].reshape(-1), reduction="sum")
        )
    return total / y.numel()


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
    trainer = Trainer(
        cfg,
        lambda **kw: CharGPT(corpus.vocab_size, cfg["context"], **cfg["model"], **kw),
        device,
        cfg["steps"],
        cfg["warmup"],
    )
    model = trainer.model
    order = torch.Generator().manual_seed(1_000_003 * cfg["seed"] + 2)
    order_hash = hashlib.sha256()
    curves: dict[str, list] = {"step": [], "train_loss": [], "val_loss": []}
    mechanism: dict[str, list] = {}
    running, seen, t_train = 0.0, 0, 0.0
    for step in range(1, cfg["steps"] + 1):
        t0 = time.perf_counter()
        xb, yb = random_windows(train_ids, cfg["batch"], cfg["context"], order)
        order_hash.update(xb[:, 0].numpy().tobytes())
        logits = model(xb.to(device))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yb.to(device).reshape(-1))
        trainer.step(loss)
        t_train += time.perf_counter() - t0
        running, seen = running + float(loss.detach()), seen + 1
        if step % cfg["eval_every"] == 0 or step == cfg["steps"]:
            model.eval()
            curves["step"].append(step)
            curves["train_loss"].append(running / seen)
            curves["val_loss"].append(_loss(model, x_eval, y_eval))
            log_mechanism(mechanism, model, lambda: model(probe))
            model.train()
            running, seen = 0.0, 0
            if not math.isfinite(curves["val_loss"][-1]):
                raise FloatingPointError(f"validation loss became {curves['val_loss'][-1]} at step {step}")
        if progress is not None:
            progress(step, cfg["steps"])
    model.eval()
    prompt = corpus.val[:1].to(device)
    sample = corpus.decode(prompt) + corpus.decode(model.sample(prompt, SAMPLE_CHARS, torch.Generator().manual_seed(0)))
    return {
        "data_source": corpus.source,
        "data_sha256": corpus.sha256,
        "pairing": {"init_sha256": trainer.fingerprint, "order_sha256": order_hash.hexdigest()[:16]},
        "metrics": {
            "final_val_loss": curves["val_loss"][-1],
            "best_val_loss": min(curves["val_loss"]),
            "final_train_loss": curves["train_loss"][-1],
            "eval_split": cfg["split"],
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


class LMFamily(Family):
    name = "lm"
    title = "character-level LM (tiny Shakespeare)"
    help = "character-level language modelling on tiny Shakespeare (or any UTF-8 text)"
    profiles = PROFILES
    experiments = EXPERIMENTS
    reproduce_order = ("lr-sweep", "main", "scaling")
    controls_experiment = "main"
    default_data_sha256 = DEFAULT_TEXT_SHA256

    def add_arguments(self, parser) -> None:
        self.add_reproduce_arguments(parser, "--data")

    def add_reproduce_arguments(self, parser, flag: str = "--text") -> None:
        parser.add_argument(
            flag,
            dest="text",
            default=None,
            help="UTF-8 text corpus (default: $STIEFEL_ATTENTION_TEXT, "
            "data/tinyshakespeare.txt or ../shared/datasets/tinyshakespeare.txt)",
        )

    def forward_arguments(self, args) -> list[str]:
        return ["--data", args.text] if getattr(args, "text", None) else []

    def cells(self, experiment: str, profile: str, seeds: int | None = None, **options) -> list[Cell]:
        return cells(experiment, profile, default_seeds(DEFAULT_SEEDS, experiment, profile) if seeds is None else seeds)

    def run_options(self, args) -> dict:
        corpus = cached_text(getattr(args, "text", None))
        if getattr(args, "profile", None) in PROFILES:  # too short a text fails here, not in every run
            check_windows(corpus, PROFILES[args.profile]["context"])
        return {"data": corpus.source}

    def data_sha256(self, run_options: dict) -> str:
        return cached_text(run_options["data"]).sha256

    def describe(self, run_options: dict) -> str:
        return f"text {run_options['data']}"

    def plan_note(self, experiment: str, profile: str) -> str:
        return sweep_note(self.name, PROFILES, profile) if experiment == "lr-sweep" else ""

    def run(self, config: dict, progress=None, **options) -> dict:
        return run(config, progress=progress, **options)

    def write_summary(self, out_dir, experiment, records, profile, plan, by_key) -> dict:
        return write_lm_report(out_dir, experiment, records, profile, plan)


FAMILY = LMFamily()
