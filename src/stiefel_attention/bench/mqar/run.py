"""Multi-query associative recall: the standard synthetic probe of attention's routing (Zoology, 2023).

`run(config) -> result` trains a CharGPT on fresh MQAR sequences every step (a seeded generator per
seed, the same in every arm) and evaluates, every `eval_every` steps, on a fixed seeded test set:
accuracy at query positions, and the first step at which it reaches 99% (censored at the budget).
The learning-rate sweep scores on a separate fixed validation set, never the test set.
"""

from __future__ import annotations

import copy
import hashlib
import math
import time

import torch
import torch.nn.functional as F

from ..arms import BOUNDED_ARMS, arm_spec
from ..models import CharGPT
from ..records import Cell
from ..sequence.family import SequenceFamily
from ..training import (
    SEQUENCE_ARMS,
    Trainer,
    log_mechanism,
    tuned_rates,
)
from .report import write_mqar_report
from .task import IGNORE, max_pairs, min_seq_len, mqar_batch

SOLVED = 0.99  # test accuracy at query positions that counts as solving the task
_OPT = dict(lr=1e-3, frame_lr=1e-2, weight_decay=0.1, betas=[0.9, 0.99], max_step=0.1, sgd_frame_lr=1.0)
PROFILES: dict[str, dict] = {
    "smoke": dict(
        model=dict(d_model=32, n_layers=2, n_heads=2, head_dim=16, mlp_ratio=2),
        vocab=32,
        n_pairs=4,
        n_queries=4,
        seq_len=16,
        batch=32,
        steps=60,
        eval_every=20,
        n_test=256,
        warmup=5,
        tuned={},
        **_OPT,
    ),
    # Under a minute of one core per run. 16 pairs: the difficulty pilot (results-pilot/mqar) found that
    # frozen random Q/K solve 4 and 8 pairs as fast as adamw, and solve 16 pairs in no seed while adamw does.
    "cpu": dict(
        model=dict(d_model=64, n_layers=2, n_heads=4, head_dim=16, mlp_ratio=2),
        vocab=64,
        n_pairs=16,
        n_queries=8,
        seq_len=40,
        batch=64,
        steps=1200,
        eval_every=50,
        n_test=1000,
        warmup=50,
        # the lr-sweep's choices (results/mqar/lr-sweep, 2 seeds on the validation set); the frame arms' other
        # parameters train at adamw's lr (training.anchor_lr)
        tuned={
            "adamw": {"lr": 3e-3},
            "adamw-orthoinit": {"lr": 3e-3},
            "adamw-qk-nodecay": {"lr": 3e-3},
            "frozen": {"lr": 3e-3},
            "qk-norm": {"lr": 3e-3},
            "stiefel-adam": {"frame_lr": 3e-2},
            "stiefel-adam-temp": {"frame_lr": 3e-2},
            "stiefel-sgd": {"frame_lr": 0.1},
            "muon": {"frame_lr": 1e-2},
            "orthogonal-param": {"frame_lr": 1e-3},
            "adamw-bounded": {"lr": 3e-3},
            "stiefel-adam-bounded": {"frame_lr": 3e-2},
            "stiefel-adam-bounded-temp": {"frame_lr": 3e-2},
            # the factorial's arms (its lr-sweep; sgd never reaches 99% at any rate: chosen by final accuracy)
            "sgd": {"frame_lr": 0.1},
            "qk-norm-sgd": {"frame_lr": 1e-2},
            "qk-norm-muon": {"frame_lr": 1e-2},
            "stiefel-muon": {"frame_lr": 1e-2},
            "stiefel-muon-bounded": {"frame_lr": 1e-2},
            "stiefel-sgd-bounded": {"frame_lr": 0.1},
            "kong-stiefel-adam": {"frame_lr": 1e-3},
            "landing-stiefel-adam": {"frame_lr": 3e-2},
        },
        **_OPT,
    ),
    "paper": dict(
        model=dict(d_model=128, n_layers=2, n_heads=4, head_dim=32, mlp_ratio=2),
        vocab=8192,
        n_pairs=16,
        n_queries=16,
        seq_len=128,
        batch=256,
        steps=10000,
        eval_every=250,
        n_test=3000,
        warmup=200,
        tuned={},
        **_OPT,
    ),
}
MAIN_ARMS = SEQUENCE_ARMS + BOUNDED_ARMS
DIFFICULTY_ARMS = ("adamw", "frozen", "stiefel-adam")
# at most mqar_task.max_pairs(vocab) pairs (distinct keys): 30 is the cpu vocabulary's largest even level
DIFFICULTY_PAIRS = {"smoke": (2, 4, 6), "cpu": (8, 16, 24, 30), "paper": (8, 16, 32, 64)}
EXPERIMENTS = ("main", "lr-sweep", "difficulty", "factorial")
DEFAULT_SEEDS = {"main": 12, "lr-sweep": 2, "difficulty": 6, "factorial": 12}
# Values an arm's sweep adds past the edge of its grid (training.LR_GRID, FRAME_LR_GRID), entered when the
# best value sat on that edge: results/mqar/lr-sweep/summary.md flags such arms.
SWEEP_EXTENSIONS: dict[str, dict[str, tuple[float, ...]]] = {
    "cpu": {
        "frozen": (3e-2,),
        "qk-norm": (3e-2,),
        "muon": (3e-2, 1e-1),
        "stiefel-sgd": (3e-2,),
        "adamw-bounded": (3e-2,),  # as qk-norm's, the other normalised arm, fixed before its sweep
        "qk-norm-sgd": (3e-3,),  # its best sat on the grid's lower edge (0.01)
        "stiefel-sgd-bounded": (3e-2,),  # its best sat on the lower edge (0.1, tied with 0.3)
    },
}
_TEST_SEED, _VAL_SEED = 10_000_019, 10_000_079  # the fixed evaluation sets; no run seed can draw these streams


def make_config(profile: str, arm: str, seed: int, split: str = "test", **overrides) -> dict:
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    spec = arm_spec(arm)
    prof = copy.deepcopy(PROFILES[profile])
    rates = tuned_rates("mqar", PROFILES, profile, arm, "test", split)
    cfg = dict(
        profile=profile,
        arm=arm,
        seed=seed,
        split=split,
        model=prof["model"],
        vocab=prof["vocab"],
        n_pairs=prof["n_pairs"],
        n_queries=prof["n_queries"],
        seq_len=prof["seq_len"],
        batch=prof["batch"],
        steps=prof["steps"],
        eval_every=prof["eval_every"],
        n_test=prof["n_test"],
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
    if cfg["n_queries"] > cfg["n_pairs"]:  # a harder level with fewer pairs than the profile's queries
        cfg["n_queries"] = cfg["n_pairs"]
    cfg["seq_len"] = max(cfg["seq_len"], min_seq_len(cfg["n_pairs"], cfg["n_queries"]))
    if cfg["n_pairs"] > max_pairs(cfg["vocab"]):
        raise ValueError(
            f"n_pairs={cfg['n_pairs']} needs distinct keys; vocabulary {cfg['vocab']} has {max_pairs(cfg['vocab'])}"
        )
    return cfg


def _cell(cfg: dict) -> Cell:
    name = f"{cfg['arm']}-s{cfg['seed']}-pairs{cfg['n_pairs']}"
    if cfg["split"] == "val":
        name += f"-val-lr{cfg['lr']:g}-flr{cfg['frame_lr']:g}"
    return Cell("mqar", name, cfg)


def cells(experiment: str, profile: str, seeds: int) -> list[Cell]:
    return FAMILY.cells(experiment, profile, seeds)


def _task(cfg: dict, batch: int, generator: torch.Generator):
    return mqar_batch(batch, cfg["vocab"], cfg["n_pairs"], cfg["n_queries"], cfg["seq_len"], generator)


@torch.no_grad()
def accuracy(model, tokens: torch.Tensor, labels: torch.Tensor, batch: int = 500) -> float:
    """Accuracy at the query positions (labels != IGNORE)."""
    correct = 0
    for i in range(0, len(tokens), batch):
        pred = model(tokens[i : i + batch]).argmax(-1)
        lab = labels[i : i + batch]
        correct += int(((pred == lab) & (lab != IGNORE)).sum())
    return correct / int((labels != IGNORE).sum())


def run(cfg: dict, device: str | None = None, progress=None) -> dict:
    t_start = time.perf_counter()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if cfg["split"] not in ("test", "val"):
        raise ValueError(f"split must be 'test' or 'val', got {cfg['split']!r}")
    eval_seed = _TEST_SEED if cfg["split"] == "test" else _VAL_SEED
    x_eval, y_eval = (t.to(device) for t in _task(cfg, cfg["n_test"], torch.Generator().manual_seed(eval_seed)))
    probe = x_eval[:32]
    trainer = Trainer(
        cfg,
        lambda **kw: CharGPT(cfg["vocab"], cfg["seq_len"], **cfg["model"], **kw),
        device,
        cfg["steps"],
        cfg["warmup"],
    )
    model = trainer.model
    order = torch.Generator().manual_seed(1_000_003 * cfg["seed"] + 2)
    order_hash = hashlib.sha256()
    curves: dict[str, list] = {"step": [], "train_loss": [], "eval_acc": []}
    mechanism: dict[str, list] = {}
    solved_at, running, seen, t_train = None, 0.0, 0, 0.0
    for step in range(1, cfg["steps"] + 1):
        t0 = time.perf_counter()
        xb, yb = _task(cfg, cfg["batch"], order)
        order_hash.update(xb[:, 0].numpy().tobytes())
        logits = model(xb.to(device))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yb.to(device).reshape(-1), ignore_index=IGNORE)
        trainer.step(loss)
        t_train += time.perf_counter() - t0
        running, seen = running + float(loss.detach()), seen + 1
        if step % cfg["eval_every"] == 0 or step == cfg["steps"]:
            model.eval()
            curves["step"].append(step)
            curves["train_loss"].append(running / seen)
            curves["eval_acc"].append(accuracy(model, x_eval, y_eval))
            log_mechanism(mechanism, model, lambda: model(probe), queries=slice(-cfg["n_queries"], None))
            model.train()
            running, seen = 0.0, 0
            if solved_at is None and curves["eval_acc"][-1] >= SOLVED:
                solved_at = step
            if not math.isfinite(curves["train_loss"][-1]):
                raise FloatingPointError(f"training loss became {curves['train_loss'][-1]} at step {step}")
        if progress is not None:
            progress(step, cfg["steps"])
    return {
        "pairing": {"init_sha256": trainer.fingerprint, "order_sha256": order_hash.hexdigest()[:16]},
        "metrics": {
            "final_eval_acc": curves["eval_acc"][-1],
            "best_eval_acc": max(curves["eval_acc"]),
            "step_eval_acc_99": solved_at,
            "eval_split": cfg["split"],
        },
        "curves": {**curves, "mechanism": mechanism},
        "timings": {
            "train_s": t_train,
            "total_s": time.perf_counter() - t_start,
            "device": str(device),
            "threads": torch.get_num_threads(),
        },
    }


class MQARFamily(SequenceFamily):
    name = "mqar"
    title = "multi-query associative recall"
    help = "multi-query associative recall (Zoology's MQAR), generated in memory"
    profiles = PROFILES
    experiments = EXPERIMENTS
    experiment_help = {
        "factorial": "geometry x optimizer on W_Q, W_K (12 cells, 2 variants), 12 paired seeds: which factor matters",
        "main": "every arm at its tuned rates, 12 paired seeds: steps to 99% recall on the test set",
        "lr-sweep": "each arm's learning rates, scored on a validation set, in two stages",
        "difficulty": "the stiefel-adam lead against the number of key-value pairs",
    }
    reproduce_order = ("lr-sweep", "difficulty", "main", "factorial")
    controls_experiment = "main"
    main_arms = MAIN_ARMS
    default_seeds = DEFAULT_SEEDS
    sweep_extensions = SWEEP_EXTENSIONS
    sweep_split = "val"
    config = staticmethod(make_config)
    cell = staticmethod(_cell)

    def own_cells(self, experiment: str, profile: str, seeds: range) -> list[Cell] | None:
        if experiment == "difficulty":
            return [
                _cell(make_config(profile, a, s, n_pairs=k))
                for k in DIFFICULTY_PAIRS[profile]
                for s in seeds
                for a in DIFFICULTY_ARMS
            ]
        return None

    def run(self, config: dict, progress=None, **options) -> dict:
        return run(config, progress=progress, **options)

    def write_summary(self, out_dir, experiment, records, profile, plan, by_key) -> dict:
        return write_mqar_report(out_dir, experiment, records, profile, plan)


FAMILY = MQARFamily()
