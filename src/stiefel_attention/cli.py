"""The `stiefel-attention` command.

    stiefel-attention certify [--json PATH] [--seed N]   float64 certification of the propositions
    stiefel-attention demo [--steps N]                   a tiny training run, adamw vs stiefel-adam
    stiefel-attention cifar --experiment NAME --profile smoke|cpu|paper [--seeds N] [--out DIR] [--data PATH]
    stiefel-attention grok --experiment single|study|slingshot --profile smoke|cpu|paper [--out DIR]
    stiefel-attention reproduce --profile smoke|cpu|paper [--out DIR]   certify, every experiment, report
    stiefel-attention report [DIR]                       rebuild summaries, plots, REPORT.md

Experiment commands take --executor local|ray (a process pool, or one Ray task per run).

Bad arguments and data problems end in one clear line on stderr and a non-zero exit, never a
traceback (set STIEFEL_ATTENTION_DEBUG=1 to see the traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

EXIT_FAILED_CHECK = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """A problem with what the user asked for, reported as one line."""


def _cmd_certify(args: argparse.Namespace) -> int:
    from .certify import certify, format_table, to_json

    t0 = time.perf_counter()
    results = certify(seed=args.seed)
    print(format_table(results))
    print(f"({time.perf_counter() - t0:.1f} s)")
    if args.json:
        try:
            to_json(results, args.json, args.seed)
        except OSError as err:
            raise UsageError(f"cannot write --json {args.json}: {err.strerror}") from None
        print(f"wrote {args.json}")
    return 0 if all(c.passed for c in results) else EXIT_FAILED_CHECK


def _cmd_demo(args: argparse.Namespace) -> int:
    """Train the default PatchViT on a synthetic 10-class image task with two arms, same seed."""
    import torch.nn.functional as F

    from .experiments.arms import HyperParameters, attention_options, build_optimizers
    from .manifold import isometry_error
    from .nn import PatchViT, qk_matrices

    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    torch.set_flush_denormal(True)
    gen = torch.Generator().manual_seed(0)
    # Class templates plus noise: learnable in a few dozen steps, no download needed.
    templates = torch.randn(10, 3, 32, 32, generator=gen)
    labels = torch.randint(0, 10, (2048,), generator=gen)
    images = templates[labels] + 2.0 * torch.randn(2048, 3, 32, 32, generator=gen)
    for arm in ("adamw", "stiefel-adam"):
        torch.manual_seed(0)
        model = PatchViT(**attention_options(arm))
        (opt,) = build_optimizers(model, arm, HyperParameters(lr=1e-3, weight_decay=0.05, frame_lr=1e-2))
        order = torch.Generator().manual_seed(1)
        t0 = time.perf_counter()
        for step in range(1, args.steps + 1):
            idx = torch.randint(0, 2048, (64,), generator=order)
            loss = F.cross_entropy(model(images[idx]), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        with torch.no_grad():
            acc = (model(images[:512]).argmax(-1) == labels[:512]).float().mean().item()
        # ||W^T W - I||_F of W_Q/W_K: ~1e-6 for frames, O(1) for the Euclidean arm's matrices
        iso = max(float(isometry_error(p)) for _, p in qk_matrices(model))
        print(f"{arm:<13} steps={args.steps} loss={loss.item():.3f} train-acc={acc:.3f} "
              f"Q/K isometry error={iso:.1e} ({time.perf_counter() - t0:.1f} s)")
    return 0


def _executor(args: argparse.Namespace):
    from .runner import InlineExecutor, LocalExecutor, RayExecutor, RayNotInstalled

    if args.executor == "ray":
        try:
            RayExecutor.import_ray()
            return RayExecutor(address=args.ray_address, cpus_per_task=args.ray_cpus_per_task,
                               gpus_per_task=args.ray_gpus_per_task, retries=args.retries)
        except RayNotInstalled as err:
            raise UsageError(str(err)) from None
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {args.jobs}")
    return InlineExecutor() if args.jobs == 1 else LocalExecutor(args.jobs)


def default_results_dir(profile: str) -> Path:
    """`results` holds the committed cpu-profile records; other profiles get their own folder, so a
    smoke run can never mix its records into (or overwrite the summaries of) the measured ones."""
    return Path("results") if profile == "cpu" else Path(f"results-{profile}")


def _check_one_profile(runs_dir: Path, profile: str) -> None:
    """Summaries describe one profile; refuse to add records of another to a folder."""
    from .report import profiles_in

    others = profiles_in(runs_dir) - {profile}
    if others:
        raise UsageError(f"{runs_dir} holds records of profile {', '.join(sorted(others))}, not {profile}; "
                         f"use another --out for the {profile} profile (default {default_results_dir(profile)})")


def _cmd_cifar(args: argparse.Namespace) -> int:
    from .data import DataError
    from .experiments import cifar
    from .report import write_cifar_report
    from .runner import read_record

    seeds = args.seeds if args.seeds is not None else cifar.default_seeds(args.experiment, args.profile)
    cells = cifar.cells(args.experiment, args.profile, seeds, n=args.n, per_n_seeds=args.seeds is None)
    try:  # fail fast, in this process, with the data module's message; also builds the cache once
        ds = cifar.cached_dataset(args.data)  # memoised: `reproduce` checks it first, then six experiments ask
    except DataError as err:
        raise UsageError(str(err)) from None
    out = Path(args.out or default_results_dir(args.profile) / "cifar")

    def report(finished: list[dict], n_planned: int) -> None:
        sweep = None
        if args.experiment == "movement":  # how the ratio depends on the SGD lr, from the sweep's records
            sweep = [read_record(c.path(out / "runs")) for c in cifar.cells("lr-sweep", args.profile, cifar.default_seeds("lr-sweep", args.profile))]
            sweep = [r for r in sweep if r is not None]
        write_cifar_report(out, args.experiment, finished, args.profile, n_planned=n_planned, sweep_records=sweep)

    print(f"cifar {args.experiment}: {len(cells)} runs ({seeds} seeds, profile {args.profile}), data {ds.source}, records in {out / 'runs'}")
    return _run_and_report("cifar", args, cells, {"data": ds.source}, report)


def _run_and_report(family: str, args: argparse.Namespace, cells: list, options: dict, report) -> int:
    """Run the missing cells, write the experiment's report, print it; non-zero if a run failed."""
    from .runner import run_cells

    options = {**options, "device": args.device, "heartbeat_s": None if args.no_progress else 60.0}
    cells = [type(c)(c.family, c.name, c.config, options) for c in cells]
    out = Path(args.out or default_results_dir(args.profile) / family)
    _check_one_profile(out / "runs", args.profile)
    records, failures = run_cells(cells, out / "runs", _executor(args), progress=not args.no_progress,
                                  desc=f"{family} {args.experiment}")
    report([records[c.key] for c in cells if c.key in records], len(cells))
    print((out / args.experiment / "summary.md").read_text())
    for cell, err in failures:
        print(f"FAILED {cell.name}: {type(err).__name__}: {err}", file=sys.stderr)
    return 1 if failures else 0


def _cmd_grok(args: argparse.Namespace) -> int:
    from .experiments import grok
    from .report import write_grok_report

    cells = grok.cells(args.experiment, args.profile, args.seeds)
    out = Path(args.out or default_results_dir(args.profile) / "grok")
    print(f"grok {args.experiment}: {len(cells)} runs (profile {args.profile}), records in {out / 'runs'}")
    return _run_and_report("grok", args, cells, {}, lambda finished, n: write_grok_report(
        out, args.experiment, finished, args.profile, n_planned=n))


# The order `reproduce` runs things in: the lr sweep first (it is how the profile's rates were
# chosen, and `movement` reads it), the cheap CIFAR experiments before the long grokking ones.
REPRODUCE_STEPS = (("cifar", "lr-sweep"), ("cifar", "main"), ("cifar", "ablation"), ("cifar", "eps"),
                   ("cifar", "movement"), ("cifar", "scaling"), ("grok", "single"), ("grok", "slingshot"),
                   ("grok", "study"))


def _cmd_reproduce(args: argparse.Namespace) -> int:
    """certify, then every experiment through the same code path as its own command, then report."""
    out = Path(args.out or default_results_dir(args.profile))
    for family in ("cifar", "grok"):  # before any run starts, not an hour in
        _check_one_profile(out / family / "runs", args.profile)
    _executor(args)  # validates --executor / --jobs (and that Ray is installed) up front
    from .data import DataError
    from .experiments import cifar

    try:  # the CIFAR experiments need the data: say so now, not after certification
        cifar.cached_dataset(args.data)
    except DataError as err:
        raise UsageError(str(err)) from None
    print(f"== certify (float64) -> {out / 'certify.json'}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    if _cmd_certify(argparse.Namespace(json=str(out / "certify.json"), seed=0)) != 0:
        print("certification failed: the optimizer does not satisfy the propositions; no experiment was run", file=sys.stderr)
        return EXIT_FAILED_CHECK
    common = ["--profile", args.profile, "--executor", args.executor, "--retries", str(args.retries),
              "--ray-cpus-per-task", str(args.ray_cpus_per_task), "--ray-gpus-per-task", str(args.ray_gpus_per_task)]
    common += ["--jobs", str(args.jobs)] if args.jobs is not None else []
    common += ["--device", args.device] if args.device else []
    common += ["--ray-address", args.ray_address] if args.ray_address else []
    common += ["--no-progress"] if args.no_progress else []
    failed = []
    parser = build_parser()
    for family, experiment in REPRODUCE_STEPS:
        print(f"\n== {family} {experiment} (profile {args.profile})", flush=True)
        argv = [family, "--experiment", experiment, "--out", str(out / family), *common]
        argv += ["--data", args.data] if family == "cifar" and args.data else []
        sub = parser.parse_args(argv)
        if sub.func(sub) != 0:
            failed.append(f"{family} {experiment}")
    print(f"\n== report {out}", flush=True)
    _cmd_report(argparse.Namespace(dir=str(out)))
    print(f"\nclaim by claim: {out / 'REPORT.md'}")
    if failed:
        print(f"some runs failed in: {', '.join(failed)} (rerun the same command to retry only those)", file=sys.stderr)
        return 1
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from .report import rebuild_all

    if not Path(args.dir).is_dir():
        raise UsageError(f"{args.dir} is not a folder (expected a results folder with cifar/runs or grok/runs)")
    for path in rebuild_all(args.dir):
        print(f"wrote {path}")
    return 0


def _add_data_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", default=None, help="CIFAR-10 source (folder or archive); default: $STIEFEL_ATTENTION_CIFAR10 or the usual places")


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """Where and how runs execute; shared by every command that trains."""
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--executor", default="local", choices=("local", "ray"),
                   help="local: a process pool on this machine (default); ray: one Ray task per run")
    p.add_argument("--jobs", type=int, default=None, help="local executor: parallel runs (default: one per core; 1 runs in this process)")
    p.add_argument("--ray-address", default=None, help="Ray cluster to join (default: $RAY_ADDRESS, else a new local cluster)")
    p.add_argument("--ray-cpus-per-task", type=float, default=1, help="CPUs per run, also its torch threads (default 1)")
    p.add_argument("--ray-gpus-per-task", type=float, default=0, help="GPUs per run (default 0; 1 for one GPU per run)")
    p.add_argument("--retries", type=int, default=2, help="ray: resubmit a failed or killed run up to N times (default 2)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stiefel-attention", description="Stiefel attention: library and benchmark suite.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("certify", help="certify the propositions numerically in float64")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--seed", type=int, default=0, help="seed of the random instances (default 0)")
    p.set_defaults(func=_cmd_certify)

    p = sub.add_parser("demo", help="a tiny training run: adamw vs stiefel-adam on synthetic images")
    p.add_argument("--steps", type=int, default=60, help="training steps per arm (default 60)")
    p.set_defaults(func=_cmd_demo)

    from .experiments.cifar import EXPERIMENTS, PROFILES

    p = sub.add_parser("cifar", help="CIFAR-10 patch benchmark experiments (paired seeds)")
    p.add_argument("--experiment", required=True, choices=EXPERIMENTS)
    p.add_argument("--profile", default="cpu", choices=list(PROFILES), help="model/training size (default cpu)")
    p.add_argument("--seeds", type=int, default=None, help="paired seeds 0..N-1 (default: 12; scaling 12 up to n=10k and 5 at 50k; lr-sweep 2; smoke 2)")
    p.add_argument("--n", type=int, default=None, help="training images for main/ablation/eps (default: the profile's)")
    p.add_argument("--out", default=None, help="results folder; runs/ inside is shared by experiments "
                   "(default: results/cifar for the cpu profile, results-PROFILE/cifar otherwise)")
    _add_data_arg(p)
    _add_run_args(p)
    p.set_defaults(func=_cmd_cifar)

    from .experiments import grok

    p = sub.add_parser("grok", help="modular-arithmetic grokking experiments")
    p.add_argument("--experiment", required=True, choices=grok.EXPERIMENTS)
    p.add_argument("--profile", default="cpu", choices=list(grok.PROFILES), help="model/training size (default cpu)")
    p.add_argument("--seeds", type=int, default=5, help="seeds per arm for the study (default 5)")
    p.add_argument("--out", default=None, help="results folder; runs/ inside is shared by experiments "
                   "(default: results/grok for the cpu profile, results-PROFILE/grok otherwise)")
    _add_run_args(p)
    p.set_defaults(func=_cmd_grok)

    p = sub.add_parser("reproduce", help="certify, run every CIFAR and grokking experiment, write the report")
    p.add_argument("--profile", default="smoke", choices=list(PROFILES), help="model/training size (default smoke: minutes)")
    p.add_argument("--out", default=None, help="results folder (default: results for the cpu profile, results-PROFILE otherwise)")
    _add_data_arg(p)
    _add_run_args(p)
    p.set_defaults(func=_cmd_reproduce)

    p = sub.add_parser("report", help="rebuild every summary, plot and REPORT.md from the run records")
    p.add_argument("dir", nargs="?", default="results", help="results folder (default: results)")
    p.set_defaults(func=_cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted; finished runs are on disk", file=sys.stderr)
        return 130
    except (UsageError, ValueError, OSError) as err:
        if os.environ.get("STIEFEL_ATTENTION_DEBUG"):
            raise
        print(f"stiefel-attention {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
