"""Multi-query associative recall: the standard synthetic probe of attention's routing (Zoology, 2023).

`run(config) -> result` trains a CharGPT on fresh MQAR sequences every step (a seeded generator per
seed, the same in every arm) and evaluates, every `eval_every` steps, on a fixed seeded test set:
accuracy at query positions, and the first step at which it reaches 99% (censored at the budget).
The learning-rate sweep scores on a separate fixed validation set, never the test set.
"""

from __future__ import annotations

import hashlib
import time

import torch
import torch.nn.functional as F

from ..arms import FACTORIAL_HELP
from ..models import CharGPT
from ..records import Cell
from ..sequence.family import SequenceFamily, sequence_config
from ..training import Trainer, log_mechanism, run_timings
from .config import (
    DEFAULT_SEEDS,
    DIFFICULTY_ARMS,
    DIFFICULTY_PAIRS,
    EXPERIMENTS,
    MAIN_ARMS,
    PROFILES,
    SOLVED,
    SWEEP_EXTENSIONS,
    TEST_SEED,
    VAL_SEED,
)
from .report import write_mqar_report
from .task import IGNORE, max_pairs, min_seq_len, mqar_batch

# a config's settings after the model
_SETTINGS = ("vocab", "n_pairs", "n_queries", "seq_len", "batch", "steps", "eval_every", "n_test", "warmup")


def make_config(profile: str, arm: str, seed: int, split: str = "test", **overrides) -> dict:
    cfg = sequence_config("mqar", PROFILES, profile, arm, seed, split, "test", _SETTINGS, overrides)
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
    eval_seed = TEST_SEED if cfg["split"] == "test" else VAL_SEED
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
    diverged = None  # a diverged run is an outcome, recorded with its step: it never solves the task
    for step in range(1, cfg["steps"] + 1):
        t0 = time.perf_counter()
        xb, yb = _task(cfg, cfg["batch"], order)
        order_hash.update(xb[:, 0].numpy().tobytes())
        logits = model(xb.to(device))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yb.to(device).reshape(-1), ignore_index=IGNORE)
        value = trainer.step_unless_blown_up(loss)
        if value is None:
            diverged = step
            break
        t_train += time.perf_counter() - t0
        running, seen = running + value, seen + 1
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
        if progress is not None:
            progress(step, cfg["steps"])
    return {
        "pairing": {"init_sha256": trainer.fingerprint, "order_sha256": order_hash.hexdigest()[:16]},
        "metrics": {
            "final_eval_acc": curves["eval_acc"][-1] if diverged is None else None,
            "best_eval_acc": max(curves["eval_acc"], default=None),
            "step_eval_acc_99": solved_at,
            "eval_split": cfg["split"],
            **({"diverged_at_step": diverged, "chance_acc": 1.0 / cfg["vocab"]} if diverged is not None else {}),
        },
        "curves": {**curves, "mechanism": mechanism},
        "timings": run_timings(t_start, t_train, device),
    }


class MQARFamily(SequenceFamily):
    name = "mqar"
    title = "multi-query associative recall"
    help = "multi-query associative recall (Zoology's MQAR), generated in memory"
    profiles = PROFILES
    experiments = EXPERIMENTS
    experiment_help = {
        "factorial": FACTORIAL_HELP,
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
