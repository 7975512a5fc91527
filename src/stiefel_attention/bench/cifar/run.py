"""CIFAR-10 patch benchmark: one training run per (arm, seed, variant), and the cells of each experiment.

`run(config) -> result` trains a PatchViT on a class-balanced subset of n training images and
evaluates on the full 10,000-image test split (or, for the learning-rate sweep only, on a
validation split carved from train). Pairing: the seed drives three independent generators,
model init (the global RNG while the model is built), the training subset, and the data order
(shuffles and flips), so arms of one seed see identical data, in identical order, from
identical initial weights everywhere except W_Q, W_K.

Profiles: `smoke` runs in seconds (tests); `cpu` is sized for 2 CPU cores (one n=10k run in
about a minute with one thread); `paper` is a larger model for a GPU.
"""

from __future__ import annotations

import copy
import hashlib
import math
import statistics
import sys
import time
from functools import lru_cache

import torch
import torch.nn.functional as F

from ...manifold import isometry_error
from ...metrics import attention_metrics
from ...nn import qk_matrices
from ..arms import FACTORIAL_ARMS, FACTORIAL_HELP, HyperParameters, arm_spec, attention_options, build_optimizers
from ..errors import NotReady
from ..family import Family, check_data, data_of, with_data
from ..models import PatchViT
from ..records import Cell
from ..training import init_fingerprint, run_timings, step_optimizers, warmup_cosine
from .config import (
    ABLATION_ARMS,
    CONTROL_ARMS,
    CONTROL_LR_GRID,
    DECAY_VALUES,
    DEFAULT_SEEDS,
    DOWNLOAD_DIR,
    EPS_VALUES,
    EXPERIMENTS,
    FACTORIAL_NEW_ARMS,
    FRAME_LR_GRID,
    LR_GRID,
    MAIN_ARMS,
    PROFILES,
    SCALING_NS,
    SCALING_SEEDS,
)
from .data import (
    CIFAR10_CLASSES,
    CIFAR10_URL,
    DEFAULT_CIFAR10_SHA256,
    SourceNotFound,
    balanced_subset,
    download_cifar10,
    load_cifar10,
    normalize,
    train_val_split,
)
from .report import claim_rows, write_cifar_report


def default_seeds(experiment: str, profile: str) -> int:
    """Paired seeds when --seeds is not given: 2 for the smoke profile (it only has to run)."""
    return 2 if profile == "smoke" else DEFAULT_SEEDS[experiment]


def epochs_for(n: int, profile: dict) -> int:
    """The profile's epochs, raised for n below the main experiment's n so that every run takes at
    least as many steps as a main run (small n would otherwise be compared after a fraction of the
    optimisation)."""
    return max(profile["epochs"], math.ceil(profile["epochs"] * profile["n_main"] / n))


def make_config(profile_name: str, arm: str, seed: int, n: int, split: str = "test", **overrides) -> dict:
    """The resolved config of one run: every hyper-parameter after profile and overrides."""
    if profile_name not in PROFILES:
        raise ValueError(f"unknown profile {profile_name!r}; choose one of {', '.join(PROFILES)}")
    arm_spec(arm)  # validates
    prof = copy.deepcopy(PROFILES[profile_name])
    tuned = prof["tuned"].get(arm, {})
    if arm in (*CONTROL_ARMS, *FACTORIAL_NEW_ARMS) and not tuned and split == "test" and profile_name != "smoke":
        raise NotReady(
            f"profile {profile_name!r} has no learning rate chosen for arm {arm!r} yet: run "
            f"`stiefel-attention cifar --experiment lr-sweep --profile {profile_name}` and enter the "
            "best validation rate in PROFILES[...]['tuned']"
        )
    # The trust region belongs to the paper's Adam rule; the fixed-step SGD arm stays degree one in
    # the gradient (a binding cap would make it partly scale free).
    max_step = prof["max_step"] if arm_spec(arm).trust_region else None
    cfg = dict(
        profile=profile_name,
        arm=arm,
        seed=seed,
        n_train=n,
        split=split,
        model=prof["model"],
        epochs=epochs_for(n, prof),
        batch_size=prof["batch_size"],
        eval_every=prof["eval_every"],
        lr=tuned.get("lr", prof["lr"]),
        frame_lr=tuned.get("frame_lr", prof["frame_lr"]),
        weight_decay=prof["weight_decay"],
        betas=[0.9, 0.999],
        eps=1e-8,
        frame_eps=1e-8,
        max_step=max_step,
        sgd_momentum=0.9,
        warmup_epochs=prof["warmup_epochs"],
        schedule="cosine",
        flip=True,
        n_val=prof["n_val"],
        n_test=prof["n_test"],
    )
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}")
    cfg.update(overrides)
    return cfg


def _cell(cfg: dict) -> Cell:
    variant = f"-n{cfg['n_train']}"
    if cfg["frame_eps"] != 1e-8:
        variant += f"-eps{cfg['frame_eps']:g}"
    if cfg["split"] == "val":
        variant += f"-val-lr{cfg['lr']:g}-flr{cfg['frame_lr']:g}"
    if cfg["weight_decay"] != PROFILES[cfg["profile"]]["weight_decay"]:
        variant += f"-wd{cfg['weight_decay']:g}"
    return Cell("cifar", f"{cfg['arm']}-s{cfg['seed']}{variant}", cfg)


def cells(experiment: str, profile: str, seeds: int, n: int | None = None, per_n_seeds: bool = False) -> list[Cell]:
    """The runs an experiment needs. Seeds are 0..seeds-1, shared (paired) across arms.

    per_n_seeds: for `scaling`, cap the seeds at each n by SCALING_SEEDS (the CLI default).
    """
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    n_main = n or PROFILES[profile]["n_main"]
    out: list[Cell] = []
    S = range(seeds)
    if experiment in ("main", "movement"):
        arms = MAIN_ARMS if experiment == "main" else ("adamw", "stiefel-sgd", "stiefel-adam")
        out = [_cell(make_config(profile, a, s, n_main)) for a in arms for s in S]
    elif experiment == "scaling":
        ns = (200, 500) if profile == "smoke" else SCALING_NS
        seeds_at = {k: min(seeds, SCALING_SEEDS.get(k, seeds)) if per_n_seeds else seeds for k in ns}
        out = [
            _cell(make_config(profile, a, s, k))
            for k in ns
            for a in ("adamw", "stiefel-adam")
            for s in range(seeds_at[k])
        ]
    elif experiment == "ablation":
        out = [_cell(make_config(profile, a, s, n_main)) for a in ABLATION_ARMS for s in S]
    elif experiment == "eps":
        out = [_cell(make_config(profile, "stiefel-adam", s, n_main, frame_eps=e)) for e in EPS_VALUES for s in S]
    elif experiment == "lr-sweep":
        out = [_cell(make_config(profile, "adamw", s, n_main, split="val", lr=lr)) for lr in LR_GRID for s in S]
        for arm, grid in FRAME_LR_GRID.items():
            out += [_cell(make_config(profile, arm, s, n_main, split="val", frame_lr=f)) for f in grid for s in S]
        for arm, grid in CONTROL_LR_GRID.items():
            grid = grid[1:3] if profile == "smoke" else grid  # smoke only has to run
            which = arm_spec(arm).swept
            out += [_cell(make_config(profile, arm, s, n_main, split="val", **{which: x})) for x in grid for s in S]
    elif experiment == "controls":
        out = [
            _cell(make_config(profile, a, s, n_main))
            for a in ("adamw", "frozen", "stiefel-adam", *CONTROL_ARMS)
            for s in S
        ]
    elif experiment == "factorial":  # cells shared with main and the controls are theirs
        out = [_cell(make_config(profile, a, s, n_main)) for a in FACTORIAL_ARMS for s in S]
    elif experiment == "decay":
        wds = (*DECAY_VALUES, PROFILES[profile]["weight_decay"])
        out = [
            _cell(make_config(profile, a, s, n_main, weight_decay=wd))
            for wd in wds
            for s in S
            for a in ("adamw", "stiefel-adam")
        ]
    else:
        raise ValueError(f"unknown experiment {experiment!r}; choose one of {', '.join(EXPERIMENTS)}")
    return out


# ---------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=2)
def cached_dataset(data: str | None):
    """load_cifar10, once per source and process (the CLI checks the data before runs ask for it)."""
    return load_cifar10(data)


def _generators(seed: int) -> tuple[torch.Generator, torch.Generator]:
    # Independent streams for the subset and the order; the model init uses torch.manual_seed(seed).
    subset = torch.Generator().manual_seed(1_000_003 * seed + 1)
    order = torch.Generator().manual_seed(1_000_003 * seed + 2)
    return subset, order


def split_indices(
    labels: torch.Tensor, cfg: dict, subset_gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Training indices (class-balanced, n of them) and, for split='val', validation indices.

    The validation split is carved from train with a generator fixed independently of the seed,
    so every sweep run is scored on the same held-out images, none of them in the test split.
    """
    if cfg["split"] == "val":
        train_pool, val_idx = train_val_split(labels, cfg["n_val"], torch.Generator().manual_seed(12345))
        sub = balanced_subset(labels[train_pool], cfg["n_train"], subset_gen)
        return train_pool[sub], val_idx
    if cfg["split"] != "test":
        raise ValueError(f"split must be 'test' or 'val', got {cfg['split']!r}")
    return balanced_subset(labels, cfg["n_train"], subset_gen), None


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1000) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(x), batch):
        correct += int((model(x[i : i + batch]).argmax(-1) == y[i : i + batch]).sum())
    model.train()
    return correct / len(x)


def run(cfg: dict, data: str | None = None, device: str | None = None, progress=None) -> dict:
    """Train one cell; return metrics, per-epoch curves, movement statistics and timings."""
    t_start = time.perf_counter()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ds = cached_dataset(str(data) if data else None)
    check_data(cfg, DEFAULT_CIFAR10_SHA256, ds.sha256, ds.source)
    subset_gen, order_gen = _generators(cfg["seed"])
    train_idx, val_idx = split_indices(ds.train_y, cfg, subset_gen)
    x_train = normalize(ds.train_x[train_idx]).to(device)  # (n, 3, 32, 32)
    y_train = ds.train_y[train_idx].to(device)
    if val_idx is not None:
        x_eval, y_eval = normalize(ds.train_x[val_idx]).to(device), ds.train_y[val_idx].to(device)
    else:
        test_idx = torch.arange(len(ds.test_y))
        if cfg["n_test"] and cfg["n_test"] < len(test_idx):
            # smoke runs only: a fixed class-balanced part of test (the files are sorted by class)
            test_idx = balanced_subset(ds.test_y, cfg["n_test"], torch.Generator().manual_seed(0))
        x_eval, y_eval = normalize(ds.test_x[test_idx]).to(device), ds.test_y[test_idx].to(device)

    torch.manual_seed(cfg["seed"])
    model = PatchViT(**cfg["model"], **attention_options(cfg["arm"])).to(device)
    hp = HyperParameters(
        lr=cfg["lr"],
        weight_decay=cfg["weight_decay"],
        frame_lr=cfg["frame_lr"],
        betas=tuple(cfg["betas"]),
        eps=cfg["eps"],
        frame_eps=cfg["frame_eps"],
        max_step=cfg["max_step"],
        sgd_momentum=cfg["sgd_momentum"],
    )
    opts = build_optimizers(model, cfg["arm"], hp)
    n = len(y_train)
    steps_per_epoch = max(1, n // cfg["batch_size"])  # drop the ragged last batch
    schedule = warmup_cosine(cfg["epochs"] * steps_per_epoch, cfg["warmup_epochs"] * steps_per_epoch)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in opts]

    def qk() -> list[torch.Tensor]:  # each (H, D, r): H matrices of one head's shape (parametrized: recomputed)
        return [p for _, p in qk_matrices(model)]

    # Fingerprints of what pairing promises is identical across arms of one seed.
    order_hash = hashlib.sha256()
    pairing = {
        "train_subset_sha256": hashlib.sha256(train_idx.numpy().tobytes()).hexdigest()[:16],
        "init_sha256": init_fingerprint(model),
    }
    curves = {"epoch": [], "train_loss": [], "train_acc": [], "eval_acc": [], "movement_median": []}
    mechanism: dict[str, list] = {}
    probe = x_train[:256]  # a fixed batch (the first training images of the seed's subset) for the attention metrics
    t_train, diverged = 0.0, None  # a diverged run is an outcome, recorded with its epoch
    for epoch in range(1, cfg["epochs"] + 1):
        t0 = time.perf_counter()
        perm = torch.randperm(n, generator=order_gen).to(device)
        flips = (torch.rand(n, generator=order_gen) < 0.5).to(device) if cfg["flip"] else None
        order_hash.update(perm.cpu().numpy().tobytes())
        if flips is not None:
            order_hash.update(flips.cpu().numpy().tobytes())
        loss_sum, correct, seen, moves = 0.0, 0, 0, []
        for b in range(steps_per_epoch):
            idx = perm[b * cfg["batch_size"] : (b + 1) * cfg["batch_size"]]
            xb, yb = x_train[idx], y_train[idx]
            if flips is not None:
                xb = torch.where(flips[idx, None, None, None], xb.flip(-1), xb)
            logits = model(xb)
            loss = F.cross_entropy(logits, yb)
            for o in opts:
                o.zero_grad(set_to_none=True)
            loss.backward()
            before = [p.detach().clone() for p in qk()]
            if not step_optimizers(opts, scheds):
                diverged = epoch
                break
            with torch.no_grad():
                # Frobenius movement of each head's W_Q / W_K matrix (d_model x head_dim) this step
                per_head = torch.cat([torch.linalg.matrix_norm(p.detach() - q) for p, q in zip(qk(), before)])
                moves.append(float(per_head.mean()))
            loss_sum += float(loss.detach()) * len(yb)
            correct += int((logits.argmax(-1) == yb).sum())
            seen += len(yb)
        t_train += time.perf_counter() - t0
        if diverged is None and not math.isfinite(loss_sum):
            diverged = epoch
        if diverged is not None:
            break
        if epoch % cfg["eval_every"] == 0 or epoch == cfg["epochs"]:
            curves["epoch"].append(epoch)
            curves["train_loss"].append(loss_sum / seen)
            curves["train_acc"].append(correct / seen)
            curves["eval_acc"].append(evaluate(model, x_eval, y_eval))
            curves["movement_median"].append(statistics.median(moves))
            model.eval()
            for name, per_layer in attention_metrics(model, lambda: model(probe)).items():
                mechanism.setdefault(name, []).append(per_layer)
            model.train()
        if progress is not None:
            progress(epoch, cfg["epochs"])

    iso = max(float(isometry_error(p)) for p in qk()) if diverged is None else None
    pairing["order_sha256"] = order_hash.hexdigest()[:16]
    return {
        "data_source": ds.source,
        "data_sha256": ds.sha256,
        "pairing": pairing,
        "metrics": {
            "final_eval_acc": curves["eval_acc"][-1] if diverged is None else None,
            "best_eval_acc": max(curves["eval_acc"], default=None),
            "eval_split": cfg["split"],
            "final_train_loss": curves["train_loss"][-1] if diverged is None else None,
            "qk_isometry_error": iso,
            "movement_median": statistics.median(curves["movement_median"]) if curves["movement_median"] else None,
            **({"diverged_at_epoch": diverged, "chance_acc": 1.0 / len(CIFAR10_CLASSES)} if diverged else {}),
        },
        "curves": {**curves, "mechanism": mechanism},
        "timings": run_timings(t_start, t_train, device),
    }


class CifarFamily(Family):
    name = "cifar"
    progress_unit = "epoch"
    title = "CIFAR-10 patches (PatchViT)"
    factorial_experiments = ("factorial",)
    help = "CIFAR-10 patch benchmark experiments (paired seeds)"
    profiles = PROFILES
    experiments = EXPERIMENTS
    experiment_help = {
        "main": "the paper's headline: stiefel-adam against adamw at the main training-set size",
        "scaling": "the stiefel-adam lead against the number of training images",
        "ablation": "which part of the update rule carries the lead (projector, scalar moment, trust region)",
        "eps": "how the frames' Adam epsilon moves the result",
        "movement": "how far W_Q, W_K travel from their start under each optimizer",
        "lr-sweep": "each arm's learning rates, scored on a validation split carved from train",
        "controls": "every geometry of W_Q, W_K at its tuned rate: when does the geometry matter?",
        "factorial": FACTORIAL_HELP,
        "decay": "the stiefel-adam lead against weight decay (the decay-exemption explanation)",
    }
    claimed = ("main", "scaling", "ablation", "eps", "movement")
    # the lr sweep first: it is how the profile's rates were chosen, and `movement` reads it
    reproduce_order = ("lr-sweep", "main", "ablation", "eps", "movement", "scaling", "controls", "decay", "factorial")
    controls_experiment = "controls"
    decay_experiment = "decay"
    default_data_sha256 = DEFAULT_CIFAR10_SHA256

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--n", type=int, default=None, help="training images for main/ablation/eps (default: the profile's)"
        )
        self.add_reproduce_arguments(parser)  # --data, --no-download

    def cells(
        self, experiment: str, profile: str, seeds: int | None = None, n: int | None = None, **options
    ) -> list[Cell]:
        if seeds is None:  # the protocol's seeds, capped per n in `scaling`
            return cells(experiment, profile, default_seeds(experiment, profile), n=n, per_n_seeds=True)
        return cells(experiment, profile, seeds, n=n)

    def add_reproduce_arguments(self, parser) -> None:
        parser.add_argument(
            "--no-download",
            action="store_true",
            help=f"when no CIFAR-10 source is found, stop instead of downloading it into {DOWNLOAD_DIR}/",
        )
        parser.add_argument(
            "--data",
            default=None,
            help="CIFAR-10 source (folder or archive); default: $STIEFEL_ATTENTION_CIFAR10 or the usual places",
        )

    def cell_options(self, args) -> dict:
        return {"n": args.n}

    def run_options(self, args) -> dict:
        # fail fast, with the data module's message (a DataError); also decodes the cache once for every run here
        try:
            return {"data": cached_dataset(getattr(args, "data", None)).source}
        except SourceNotFound:
            if getattr(args, "no_download", False):
                raise
        print(
            f"CIFAR-10 not found: downloading the canonical archive ({CIFAR10_URL}, 163 MB, md5-checked) into "
            f"{DOWNLOAD_DIR}/ (--no-download to refuse)",
            file=sys.stderr,
            flush=True,
        )
        return {"data": cached_dataset(str(download_cifar10(DOWNLOAD_DIR))).source}

    def data_sha256(self, run_options: dict) -> str:
        return cached_dataset(run_options["data"]).sha256

    def describe(self, run_options: dict) -> str:
        return f"data {run_options['data']}"

    def run(self, config: dict, progress=None, **options) -> dict:
        return run(config, progress=progress, **options)

    def experiment_records(self, experiment: str, profile: str, by_key: dict[str, dict]) -> list[dict]:
        """The records of one experiment, by the keys of the cells it plans.

        An experiment other than `scaling` compares arms at ONE n (the profile's, or another one
        chosen with --n): the records of each n are a separate experiment and must never be pooled
        (the scaling runs at n=1k share arms and seeds with `main`). The profile's n wins; failing
        that, the n with the most records.
        """
        mine = [r for r in by_key.values() if r["config"]["profile"] == profile]
        seeds = 1 + max((r["config"]["seed"] for r in mine), default=0)
        data = data_of(mine)
        try:  # as its command plans it: e.g. the controls wait for every control arm's swept rate (except at smoke)
            cells(experiment, profile, 1)
        except NotReady:
            return []
        if experiment == "scaling":
            return [by_key[c.key] for c in with_data(cells(experiment, profile, seeds), data) if c.key in by_key]
        sizes = sorted({r["config"]["n_train"] for r in mine})
        groups = {
            n: [by_key[c.key] for c in with_data(cells(experiment, profile, seeds, n=n), data) if c.key in by_key]
            for n in sizes
        }
        n_main = PROFILES[profile]["n_main"]
        if groups.get(n_main):
            return groups[n_main]
        return max(groups.values(), key=len, default=[])

    def write_summary(self, out_dir, experiment, records, profile, plan, by_key) -> dict:
        sweep = None
        if experiment == "movement":  # how the ratio depends on the SGD lr, from the sweep's records
            seeds = 1 + max((r["config"]["seed"] for r in by_key.values()), default=0)
            sweep = [
                by_key[c.key] for c in with_data(cells("lr-sweep", profile, seeds), data_of(records)) if c.key in by_key
            ]
        return write_cifar_report(out_dir, experiment, records, profile, plan=plan, sweep_records=sweep)

    def claim_rows(self, experiment, summary, link, profile):
        return claim_rows(experiment, summary, link, profile)


FAMILY = CifarFamily()
