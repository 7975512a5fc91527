"""Modular-arithmetic grokking: baseline (AdamW everywhere) vs Stiefel W_Q, W_K; slingshot pilot.

`run(config) -> result` trains a ModularTransformer full-batch on (a op b) mod p and logs
train/validation loss and accuracy, the unembedding's weight norm and the Q/K isometry error
every `eval_every` epochs. The seed fixes the model init (global RNG while building) and, by
default, the train/validation split (its own generator, `split_seed`), identically in every arm.

Q/K isometry error: for frames, max over heads of ||W^T W - I||_F. For Euclidean W_Q, W_K, whose
scale is free, the same quantity after normalising each column to unit norm: it then measures
only how far the columns are from orthogonal, the part of the geometry a frame pins down, and
not the scale that weight decay and the softmax temperature trade against each other. With one
layer the query is read only at '=', the same input for every equation, so every W_Q and W_K
gradient is rank one and unconstrained heads drift towards rank one, where the measure reaches
its maximum sqrt(r(r-1)).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from ...manifold import isometry_error
from ...metrics import attention_metrics
from ...nn import qk_clip, qk_matrices, reset_logit_stats
from ..arms import HyperParameters, arm_spec, attention_options, build_optimizers
from ..family import Family
from ..models import ModularTransformer
from ..records import Cell
from ..training import step_optimizers
from .config import (
    ARMS,
    BASE,
    CONTROL_ARMS,
    DECAY_VALUES,
    DEFAULT_SEEDS,
    EXPERIMENTS,
    GROK_THRESHOLD,
    INTERVENTION_KEYS,
    INTERVENTIONS,
    PROFILES,
    SLINGSHOT,
    SLINGSHOT_OPS,
    STUDY_OPS,
    intervention_tag,
)
from .interventions import mechanism_answer
from .report import claim_rows, write_grok_report
from .task import modular_task


def make_config(profile: str, arm: str, seed: int, op: str = "+", **overrides) -> dict:
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    prof = PROFILES[profile]
    cfg = dict(
        profile=profile,
        arm=arm,
        seed=seed,
        split_seed=seed,
        op=op,
        model=dict(prof["model"]),
        epochs=prof["epochs"],
        eval_every=prof["eval_every"],
        **BASE,
    )
    if not arm_spec(arm).trust_region:
        cfg["max_step"] = None
    unknown = set(overrides) - set(cfg) - set(INTERVENTION_KEYS)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}")
    if "qk_clip" in overrides and not (arm_spec(arm).qk == "euclidean" and "qk_norm" not in arm_spec(arm).attention):
        raise ValueError(f"qk_clip needs Euclidean W_Q, W_K without qk_norm; arm {arm!r} has neither")
    cfg.update(overrides)
    return cfg


def _cell(cfg: dict, tag: str = "") -> Cell:
    op_name = {"+": "add", "-": "sub", "*": "mul", "/": "div"}[cfg["op"]]
    tag = intervention_tag(cfg).replace("+", "-") + tag
    return Cell("grok", f"{cfg['arm']}-s{cfg['seed']}-{op_name}{tag}", cfg)


def cells(experiment: str, profile: str, seeds: int = 5) -> list[Cell]:
    if experiment == "single":
        return [_cell(make_config(profile, a, 0, "+")) for a in ARMS]
    if experiment == "study":
        if seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {seeds}")
        # seed-major: a study stopped part-way holds complete pairs, not one arm's seeds
        return [_cell(make_config(profile, a, s, op)) for op in STUDY_OPS for s in range(seeds) for a in ARMS]
    if experiment in ("controls", "decay") and seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    if experiment == "controls":
        first, rest = CONTROL_ARMS[:3], CONTROL_ARMS[3:]
        return [
            _cell(make_config(profile, a, s, "+")) for group in (first, rest, ARMS) for s in range(seeds) for a in group
        ]
    if experiment == "decay":
        return [
            _cell(make_config(profile, a, s, "+", weight_decay=wd))
            for wd in (*DECAY_VALUES, BASE["weight_decay"])
            for s in range(seeds)
            for a in ARMS
        ]
    if experiment == "interventions":
        if seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {seeds}")
        # seed-major, the interventions first (the plain arms of each op are the controls' and study's runs)
        plain = [(arm, op, {}) for op in ("+", "-") for arm in ARMS]
        return [
            _cell(make_config(profile, arm, s, op, **extra))
            for s in range(seeds)
            for arm, op, extra in (*INTERVENTIONS, *plain)
        ]
    if experiment == "slingshot":
        epochs = PROFILES[profile]["slingshot_epochs"]
        over = dict(
            weight_decay=SLINGSHOT["weight_decay"],
            regularize=SLINGSHOT["regularize"],
            betas=SLINGSHOT["betas"],
            epochs=epochs,
        )
        return [_cell(make_config(profile, a, 0, op, **over), "-slingshot") for op in SLINGSHOT_OPS for a in ARMS]
    raise ValueError(f"unknown experiment {experiment!r}; choose one of {', '.join(EXPERIMENTS)}")


# ---------------------------------------------------------------------------------------------


def qk_isometry(model: torch.nn.Module) -> float:
    """Max over W_Q, W_K heads of ||W^T W - I||_F, after column normalisation for Euclidean Q/K."""
    worst = 0.0
    for _, W in qk_matrices(model):
        W = W.detach()
        if getattr(model.blocks[0].attn, "qk", "stiefel") == "euclidean":
            W = W / torch.linalg.vector_norm(W, dim=-2, keepdim=True).clamp_min(1e-30)
        worst = max(worst, float(isometry_error(W)))
    return worst


# regularize="non-qk" (the slingshot conditions): the optimizer of an arm whose W_Q, W_K would
# otherwise decay is that of its no-decay twin; the other arms' Q/K never decay anyway.
_NO_QK_DECAY_TWIN = {"adamw": "adamw-qk-nodecay"}


def _build(cfg: dict, model: ModularTransformer) -> list[torch.optim.Optimizer]:
    arm = cfg["arm"]
    if cfg["regularize"] == "non-qk":
        arm = _NO_QK_DECAY_TWIN.get(arm, arm)
        if arm_spec(arm).decays_qk:
            raise ValueError(f"regularize='non-qk' is not defined for arm {cfg['arm']!r}")
    elif cfg["regularize"] != "all":
        raise ValueError(f"regularize must be 'all' or 'non-qk', got {cfg['regularize']!r}")
    hp = HyperParameters(
        lr=cfg["lr"],
        weight_decay=cfg["weight_decay"],
        frame_lr=cfg["frame_lr"],
        betas=tuple(cfg["betas"]),
        max_step=cfg["max_step"],
    )
    return build_optimizers(model, arm, hp)


def run(cfg: dict, device: str | None = None, progress=None, checkpoint=None) -> dict:
    """Train one cell. checkpoint (a partial.Checkpoint): resume from its saved state, if any, and save the
    state whenever it is due; the run then ends exactly as one never cut off."""
    t_start = time.perf_counter()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    m = cfg["model"]
    task = modular_task(m["p"], cfg["op"], cfg["train_fraction"], cfg["split_seed"])
    xt, yt = task.train_tokens.to(device), task.train_labels.to(device)
    xv, yv = task.val_tokens.to(device), task.val_labels.to(device)
    tau = cfg.get("qk_clip")

    def fresh() -> tuple[ModularTransformer, list, list]:
        """The model (from the seed), its optimizers and schedules, as at the first epoch."""
        torch.manual_seed(cfg["seed"])
        logit_options = {k: cfg[k] for k in ("logit_softcap", "logit_scale") if k in cfg}
        model = ModularTransformer(
            **m, **attention_options(cfg["arm"]), **logit_options, track_logits=tau is not None
        ).to(device)
        opts = _build(cfg, model)
        warm = cfg["warmup_steps"]
        lam = lambda step: min(1.0, (step + 1) / warm) if warm else 1.0  # noqa: E731
        return model, opts, [torch.optim.lr_scheduler.LambdaLR(o, lam) for o in opts]

    model, opts, scheds = fresh()

    log: dict[str, list] = {
        k: [] for k in ("epoch", "train_loss", "train_acc", "val_loss", "val_acc", "unembed_norm", "qk_isometry")
    }
    mechanism: dict[str, list] = {}
    if tau is not None:  # how often QK-Clip fired: heads clipped, cumulative, at each evaluation
        log["qk_clip_heads"] = []
    clip_heads = clip_steps = 0
    first_grok = None
    diverged = None  # a diverged run is an outcome, recorded with its epoch: it never groks after it
    t_train = 0.0
    start = 1
    walls: list[float | None] = []  # wall-clock of each earlier stretch, up to its last checkpoint
    saved = checkpoint.load() if checkpoint is not None else None
    if saved is not None:
        try:  # a state that does not fit (another model or optimizer layout, a key missing) is not resumed
            if len(saved["opts"]) != len(opts) or len(saved["scheds"]) != len(scheds):
                raise ValueError(f"it holds {len(saved['opts'])} optimizer states; this run has {len(opts)}")
            model.load_state_dict(saved["model"])
            for o, state in zip(opts, saved["opts"]):
                o.load_state_dict(state)
            for sched, state in zip(scheds, saved["scheds"]):
                sched.load_state_dict(state)
            counters = tuple(saved["counters"])
            if len(counters) != 4 or set(saved["log"]) != set(log):
                raise ValueError(f"it logs {sorted(saved['log'])} and {len(counters)} counters; this run {sorted(log)}")
            # None: a checkpoint written before stretches were timed
            restored = (saved["log"], saved["mechanism"], counters, saved["epoch"] + 1, saved.get("walls", [None]))
            torch.set_rng_state(saved["rng"])
        except Exception as err:
            checkpoint.reject(err)
            saved = None
            model, opts, scheds = fresh()  # as never resumed: the seed's model, new optimizers
        else:
            log, mechanism, (clip_heads, clip_steps, first_grok, t_train), start, walls = restored
    for epoch in range(start, cfg["epochs"] + 1):
        t0 = time.perf_counter()
        if tau is not None:
            reset_logit_stats(model)  # the clip reads this step's training forward only
        logits = model(xt)
        loss = F.cross_entropy(logits, yt)
        if not torch.isfinite(loss):
            diverged = epoch
            break
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss.backward()
        if not step_optimizers(opts, scheds):
            diverged = epoch
            break
        if tau is not None:
            clipped = qk_clip(model, tau)
            clip_heads, clip_steps = clip_heads + clipped, clip_steps + (clipped > 0)
        t_train += time.perf_counter() - t0
        if epoch % cfg["eval_every"] == 0 or epoch == cfg["epochs"] or epoch == 1:
            with torch.no_grad():
                vlogits = model(xv)
                log["epoch"].append(epoch)
                log["train_loss"].append(float(loss.detach()))
                log["train_acc"].append(float((logits.argmax(-1) == yt).float().mean()))
                log["val_loss"].append(float(F.cross_entropy(vlogits, yv)))
                log["val_acc"].append(float((vlogits.argmax(-1) == yv).float().mean()))
                log["unembed_norm"].append(float(model.unembed.weight.norm()))
                log["qk_isometry"].append(qk_isometry(model))
                if tau is not None:
                    log["qk_clip_heads"].append(clip_heads)
            # the attention the model reads: the '=' query, on a fixed batch of training equations
            point = attention_metrics(model, lambda: model.forward_full(xt[:512]), queries=slice(-1, None))
            for name, per_layer in point.items():
                mechanism.setdefault(name, []).append(per_layer)
            if first_grok is None and log["val_acc"][-1] >= GROK_THRESHOLD:
                first_grok = epoch
        if checkpoint is not None and epoch < cfg["epochs"] and checkpoint.due():
            state = {
                "model": model.state_dict(),
                "opts": [o.state_dict() for o in opts],
                "scheds": [sched.state_dict() for sched in scheds],
                "log": log,
                "mechanism": mechanism,
                "counters": (clip_heads, clip_steps, first_grok, t_train),
                "rng": torch.get_rng_state(),
                "epoch": epoch,
                "walls": [*walls, time.perf_counter() - t_start],
            }
            checkpoint.save(epoch, state)
        if progress is not None:
            progress(epoch, cfg["epochs"])
    wall = time.perf_counter() - t_start
    timings = {"train_s": t_train, "total_s": wall}
    if saved is not None:  # a resumed run: total_s covers every stretch, or is unknown (None)
        timings["walls"] = [*walls, wall]
        timings["total_s"] = None if None in walls else sum(timings["walls"])
    if diverged is not None and saved is not None and diverged == start:
        # blown up on its first epoch after resuming: the checkpoint is the suspect, not the training, so this is a
        # failure (the runner deletes the checkpoint and the next attempt starts afresh), not a diverged run
        raise FloatingPointError(f"training blew up at epoch {diverged}, the first after resuming from a checkpoint")
    trained = cfg["epochs"] if diverged is None else diverged - 1
    return {
        "metrics": {
            "final_val_acc": log["val_acc"][-1] if diverged is None else None,  # None: see chance_acc
            "final_train_acc": log["train_acc"][-1] if diverged is None else None,
            "epoch_val_acc_95": first_grok,  # None: never reached within the run
            "max_qk_isometry": max(log["qk_isometry"], default=None),
            "collapses": find_collapses(log),
            **({"qk_clip_steps": clip_steps, "qk_clip_heads": clip_heads} if tau is not None else {}),
            **({"diverged_at_epoch": diverged, "chance_acc": 1.0 / m["p"]} if diverged is not None else {}),
        },
        "curves": {**log, "mechanism": mechanism},
        "timings": {
            **timings,
            "epochs_per_s": trained / t_train if t_train else None,
            "device": str(device),
            "threads": torch.get_num_threads(),
        },
    }


def find_collapses(
    log: dict, spike: float = 10.0, fitted: float = 1e-2, recovered: float = GROK_THRESHOLD
) -> list[dict]:
    """Slingshot-style collapses in a logged run.

    A collapse starts where the training loss, after the network has fitted the training set
    (running minimum below `fitted`), rises above `spike` x that minimum, and ends where it falls
    back below that level. It is survived if validation accuracy is back at >= `recovered` at
    some logged point after it ends and before the next collapse starts (or the run ends).
    """
    loss, val = log["train_loss"], log["val_acc"]
    spans: list[tuple[int, int, float]] = []  # (start, end exclusive, loss level before)
    best, start = math.inf, None
    for i, value in enumerate(loss):
        if start is None:
            if best < fitted and value > spike * best:
                start = i
            else:
                best = min(best, value)
        elif value <= spike * best:
            spans.append((start, i, best))
            start, best = None, value
    if start is not None:
        spans.append((start, len(loss), best))
    events = []
    for k, (a, b, level) in enumerate(spans):
        next_start = spans[k + 1][0] if k + 1 < len(spans) else len(loss)
        events.append(
            {
                "epoch": log["epoch"][a],
                "train_loss_before": level,
                "train_loss_peak": max(loss[a:b]),
                "val_acc_before": val[a - 1] if a > 0 else None,
                "val_acc_min": min(val[a:b]),
                "survived": b < len(loss) and max(val[b:next_start], default=0.0) >= recovered,
            }
        )
    return events


class GrokFamily(Family):
    name = "grok"
    progress_unit = "epoch"
    resumable = True
    title = "modular addition (grokking)"
    help = "modular-arithmetic grokking experiments"
    profiles = PROFILES
    experiments = EXPERIMENTS
    experiment_help = {
        "single": "one run per arm of (a + b) mod p: the paper's grokking curve",
        "study": "the paper's grokking claims over operations and paired seeds",
        "slingshot": "the slingshot pilot: long training with the paper's unusual Adam settings",
        "controls": "every geometry of W_Q, W_K on a + b: when does the geometry matter?",
        "decay": "the stiefel-adam lead against weight decay",
        "interventions": "the mechanism: interventions on the attention-logit scale, in both directions",
    }
    claimed = ("single", "study", "slingshot")
    reproduce_order = ("single", "slingshot", "study", "controls", "decay", "interventions")
    controls_experiment = "controls"
    decay_experiment = "decay"
    mechanism_experiment = "interventions"

    @staticmethod
    def protocol_seeds(experiment: str, profile: str) -> int:
        """The seeds an experiment plans by default; the smoke profile only has to run."""
        return min(2, DEFAULT_SEEDS[experiment]) if profile == "smoke" else DEFAULT_SEEDS[experiment]

    def cells(self, experiment: str, profile: str, seeds: int | None = None, **options) -> list[Cell]:
        return cells(experiment, profile, self.protocol_seeds(experiment, profile) if seeds is None else seeds)

    def run(self, config: dict, progress=None, **options) -> dict:
        return run(config, progress=progress, **options)

    def write_summary(self, out_dir, experiment, records, profile, plan, by_key) -> dict:
        context = None
        if experiment == "interventions":  # the figure of the mechanism puts the controls' runs beside them
            seeds = 1 + max((r["config"]["seed"] for r in by_key.values()), default=0)
            context = [by_key[c.key] for c in cells("controls", profile, seeds) if c.key in by_key]
        seeds = self.protocol_seeds(experiment, profile)
        return write_grok_report(out_dir, experiment, records, profile, plan, context, planned_seeds=seeds)

    def mechanism_answer(self, experiment, summary):
        return mechanism_answer(summary, self.title) if experiment == self.mechanism_experiment else None

    def claim_rows(self, experiment, summary, link, profile):
        return claim_rows(experiment, summary, link, profile)


FAMILY = GrokFamily()
