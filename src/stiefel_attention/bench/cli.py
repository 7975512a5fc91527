"""The `stiefel-attention` command.

    stiefel-attention certify [--json PATH] [--seed N]   float64 certification of the propositions
    stiefel-attention demo [--steps N]                   a tiny training run, adamw vs stiefel-adam
    stiefel-attention list [FAMILY]                      families, experiments, arms, planned runs and time
    stiefel-attention FAMILY --experiment NAME --profile smoke|cpu|paper [--seeds N|A-B|A,B] [--set K=V]
                             [--out DIR] ...             one experiment of a family (cifar, grok, lm, ...)
    stiefel-attention reproduce --profile smoke|cpu|paper [--out DIR]   certify, every experiment, report
    stiefel-attention report [DIR]                       rebuild summaries, plots, REPORT.md
    stiefel-attention rerun RECORD...                    re-run recorded runs; are they reproduced exactly?

Experiment commands take --executor local|ray (a process pool, or one Ray task per run).

Bad arguments and data problems end in one clear line on stderr and a non-zero exit, never a
traceback (set STIEFEL_ATTENTION_DEBUG=1 to see the traceback).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import torch

from .experiment import (
    RunRequest,
    check_device,
    check_folder_for,
    default_results_dir,
    run_experiment,
)
from .family import FAMILY_MODULES, UserError, all_families, family_names, get_family

EXIT_FAILED_CHECK = 1
EXIT_USAGE = 2


def _check_output_file(path: str, flag: str) -> None:
    """Before any work: PATH can be written (its folder exists and takes files; PATH is not a folder)."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise UserError(f"{flag} {path}: is a folder; give a file name")
    if not folder.is_dir():
        raise UserError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise UserError(f"{flag} {path}: not writable here")


def _cmd_certify(args: argparse.Namespace) -> int:
    return certify_into(args.json, args.seed)


def certify_into(json_path: str | None, seed: int) -> int:
    """Certify the propositions (float64), print the table, and write it to json_path (checked first) if given."""
    from ..certify import certify, format_table, to_json

    if json_path:
        _check_output_file(json_path, "--json")
    t0 = time.perf_counter()
    results = certify(seed=seed)
    print(format_table(results))
    print(f"({time.perf_counter() - t0:.1f} s)")
    if json_path:
        try:
            to_json(results, json_path, seed)
        except OSError as err:
            raise UserError(f"cannot write --json {json_path}: {err.strerror}") from None
        print(f"wrote {json_path}")
    return 0 if all(c.passed for c in results) else EXIT_FAILED_CHECK


def _cmd_demo(args: argparse.Namespace) -> int:
    """Train the default PatchViT on a synthetic 10-class image task with two arms, same seed, and say what the
    two show: how far each arm's W_Q, W_K are from orthonormal, and the training accuracy each reached."""
    import torch.nn.functional as F

    from ..manifold import isometry_error
    from ..nn import qk_matrices
    from .arms import HyperParameters, attention_options, build_optimizers
    from .models import PatchViT

    if args.steps < 1:
        raise UserError(f"--steps must be >= 1, got {args.steps}")
    check_device(args.device)
    device = torch.device(args.device or "cpu")
    torch.set_flush_denormal(True)
    gen = torch.Generator().manual_seed(args.seed)
    # Class templates plus noise: learnable in a few dozen steps, no download needed.
    templates = torch.randn(10, 3, 32, 32, generator=gen)
    labels = torch.randint(0, 10, (2048,), generator=gen)
    images = (templates[labels] + 2.0 * torch.randn(2048, 3, 32, 32, generator=gen)).to(device)
    labels = labels.to(device)
    seen = {}
    for arm in ("adamw", "stiefel-adam"):
        torch.manual_seed(args.seed)
        model = PatchViT(**attention_options(arm)).to(device)
        (opt,) = build_optimizers(model, arm, HyperParameters(lr=1e-3, weight_decay=0.05, frame_lr=1e-2))
        order = torch.Generator().manual_seed(args.seed + 1)
        t0 = time.perf_counter()
        for step in range(1, args.steps + 1):
            idx = torch.randint(0, 2048, (64,), generator=order).to(device)
            loss = F.cross_entropy(model(images[idx]), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if sys.stderr.isatty() and (step % 5 == 0 or step == args.steps):
                print(f"\r{arm}: step {step}/{args.steps} loss {loss.item():.3f}", end="", file=sys.stderr)
        if sys.stderr.isatty():
            print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
        with torch.no_grad():
            acc = (model(images[:512]).argmax(-1) == labels[:512]).float().mean().item()
        # ||W^T W - I||_F of W_Q/W_K: ~1e-6 for frames, O(1) for the Euclidean arm's matrices
        iso = max(float(isometry_error(p)) for _, p in qk_matrices(model))
        seen[arm] = (acc, iso)
        print(
            f"{arm:<13} steps={args.steps} loss={loss.item():.3f} train-acc={acc:.3f} "
            f"Q/K isometry error={iso:.1e} ({time.perf_counter() - t0:.1f} s on {device})"
        )
    print(demo_conclusion(seen, args.steps))
    return 0


def demo_conclusion(seen: dict[str, tuple[float, float]], steps: int) -> str:
    """The demo's one line: what the two arms show (seen: arm -> (training accuracy, Q/K isometry error))."""
    (acc_a, iso_a), (acc_s, iso_s) = seen["adamw"], seen["stiefel-adam"]
    kept = "stay orthonormal" if iso_s < 1e-4 else "left the manifold (a bug: please report it)"
    gap = acc_s - acc_a
    which = "level with" if abs(gap) < 0.02 else "ahead of" if gap > 0 else "behind"
    return (
        f"In short: stiefel-adam's W_Q, W_K {kept} (isometry error {iso_s:.0e}; adamw's {iso_a:.1e}), and after "
        f"{steps} steps its training accuracy is {which} adamw's ({acc_s:.3f} vs {acc_a:.3f}; one seed of a toy "
        "task, a check that training runs, not a measurement: the measurements are in results/REPORT.md)."
    )


@functools.cache
def _run_seconds(runs_dir: Path) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Each record's run time in runs_dir ({key: total_s}) and the run times of each arm."""
    from .records import read_record

    by_key: dict[str, float] = {}
    by_arm: dict[str, list[float]] = {}
    for path in sorted(runs_dir.glob("*.json")) if runs_dir.is_dir() else ():
        record = read_record(path, warn=False)
        seconds = (record or {}).get("timings", {}).get("total_s")
        if isinstance(seconds, (int, float)):
            by_key[record["key"]] = float(seconds)
            by_arm.setdefault(record["config"].get("arm", ""), []).append(float(seconds))
    return by_key, by_arm


def _plan_line(family, experiment: str, profile: str) -> str:
    """`list`'s line for one experiment at one profile: planned runs, how many the default folder holds, and
    the core-hours still to run, estimated from the run times recorded there (each cell's arm's median)."""
    import statistics

    try:
        cells = family.cells(experiment, profile)
    except (ValueError, UserError) as err:
        return f"{profile}: cannot plan yet ({str(err).split(': ')[0]})"
    by_key, by_arm = _run_seconds(default_results_dir(profile) / family.name / "runs")
    line = f"{profile}: {len(cells)} runs"
    if not by_key:
        return line
    todo = [c for c in cells if c.key not in by_key]
    everything = statistics.median(s for times in by_arm.values() for s in times)
    rest = sum(statistics.median(by_arm.get(c.config.get("arm", ""), [everything])) for c in todo)
    line += f", {len(cells) - len(todo)} recorded"
    return line + (f", the rest about {rest / 3600:.1f} core-hours" if todo else "")


def _cmd_list(args: argparse.Namespace) -> int:
    """Families, their experiments (what each answers), arms, and each experiment's planned runs per profile."""
    families = [get_family(args.family)] if args.family else all_families()
    for family in families:
        print(f"{family.name}: {family.help}")
        arms: dict[str, None] = {}
        for experiment in family.experiments:
            print(f"  --experiment {experiment}: {family.experiment_help.get(experiment, '')}")
            plans = [_plan_line(family, experiment, profile) for profile in family.profiles]
            print(f"      {'; '.join(plans)}")
            for cell in family.cells(experiment, "smoke"):  # smoke plans every arm without waiting for a sweep
                arms[str(cell.config.get("arm"))] = None
        print(f"  arms: {', '.join(arms)}\n")
    print(
        "Core-hours are estimated from the run times of the records in each profile's default folder (results "
        "for cpu, results-PROFILE otherwise), one core per run; see `stiefel-attention FAMILY --help`."
    )
    return 0


def _executor(args: argparse.Namespace):
    from .runner import InlineExecutor, LocalExecutor, RayExecutor, RayNotInstalled

    if args.executor == "ray":
        try:
            RayExecutor.import_ray()
            return RayExecutor(
                address=args.ray_address,
                cpus_per_task=args.ray_cpus_per_task,
                gpus_per_task=args.ray_gpus_per_task,
                retries=args.retries,
            )
        except RayNotInstalled as err:
            raise UserError(str(err)) from None
    if args.jobs is not None and args.jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {args.jobs}")
    return InlineExecutor() if args.jobs == 1 else LocalExecutor(args.jobs)


def parse_seeds(text: str) -> int | tuple[int, ...]:
    """--seeds: a count N (seeds 0..N-1, as before), a range A-B (both ends included) or a list A,B,...;
    ranges and lists may mix ("0-2,7"). A count is returned as an int, anything else as sorted seeds."""
    text = text.strip()
    if text.isdigit():
        if int(text) < 1:
            raise argparse.ArgumentTypeError(f"a count of seeds must be >= 1, got {text}")
        return int(text)
    seeds: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a count (3), a range (0-4) or a list (5,7) of seeds >= 0"
            )
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise argparse.ArgumentTypeError(f"the range {part.strip()!r} runs backwards")
        seeds.update(range(lo, hi + 1))
    return tuple(sorted(seeds))


def parse_setting(text: str) -> tuple[str, object]:
    """--set KEY=VALUE: a dotted path into a run's config (model.d_model) and a JSON value (a bare word that
    is not JSON is a string); family.with_data applies it."""
    import json

    key, eq, value = text.partition("=")
    if not eq or not key.strip() or any(not part for part in key.strip().split(".")):
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (e.g. steps=600, model.d_model=128)")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return key.strip(), parsed


def _family_command(args: argparse.Namespace) -> int:
    """`stiefel-attention <family> --experiment NAME ...`: the flags as one RunRequest, then run_experiment."""
    family = get_family(args.command)
    check_device(args.device)
    request = RunRequest(
        family=family,
        experiment=args.experiment,
        profile=args.profile,
        out=Path(args.out or default_results_dir(args.profile) / family.name),
        executor=_executor(args),  # validates --executor / --jobs (and that Ray is installed) up front
        run_options=family.run_options(args),
        seeds=args.seeds,
        arms=args.arms,
        settings=dict(args.set),
        cell_options=family.cell_options(args),
        device=args.device,
        progress=not args.no_progress,
    )
    return run_experiment(request)


def _cmd_reproduce(args: argparse.Namespace) -> int:
    """certify, then every family's experiments through the same code path as their own commands, then report."""
    from .report.document import check_placed, place_records

    out = Path(args.out or default_results_dir(args.profile))
    families = all_families()
    check_device(args.device)
    _executor(args)  # validates --executor / --jobs (and that Ray is installed) up front
    for family in families:  # data, output folders: say so now, not after certification or an hour in
        check_folder_for(family, out / family.name / "runs", args.profile, family.run_options(args))
    check_placed([place_records(out / f.name, f) for f in families], args.leave_out_unplanned)  # the final report's
    print(f"== certify (float64) -> {out / 'certify.json'}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    if certify_into(str(out / "certify.json"), seed=0) != 0:
        print(
            "certification failed: the optimizer does not satisfy the propositions; no experiment was run",
            file=sys.stderr,
        )
        return EXIT_FAILED_CHECK
    failed: list[str] = []
    refused: list[str] = []
    for family in families:
        run_options = family.run_options(args)
        for experiment in family.reproduce_order or family.experiments:
            print(f"\n== {family.name} {experiment} (profile {args.profile})", flush=True)
            request = RunRequest(
                family=family,
                experiment=experiment,
                profile=args.profile,
                out=out / family.name,
                executor=_executor(args),
                run_options=run_options,
                device=args.device,
                progress=not args.no_progress,
            )
            try:
                if run_experiment(request) != 0:
                    failed.append(f"{family.name} {experiment}")
            except UserError as err:  # e.g. NotReady after a failed sweep run: the other experiments still run
                print(f"not run: {family.name} {experiment}: {err}", file=sys.stderr, flush=True)
                refused.append(f"{family.name} {experiment} ({err})")
    print(f"\n== report {out}", flush=True)
    report_folder(str(out), [], args.leave_out_unplanned)
    print(f"\nclaim by claim: {out / 'REPORT.md'}")
    if failed:
        print(f"some runs failed in: {', '.join(failed)} (rerun the same command to retry only those)", file=sys.stderr)
    if refused:
        print(f"not run: {'; '.join(refused)} (the same command resumes after the fix)", file=sys.stderr)
    return 1 if failed or refused else 0


def _cmd_rerun(args: argparse.Namespace) -> int:
    """Re-run committed records' cells in this process and say whether every metric and curve is identical."""
    from .records import Cell, read_record, write_json_atomic
    from .runner import execute_cell, record_differences

    check_device(args.device)
    reruns: list[dict] = []
    if args.json:  # before any re-run, which may take an hour: the file can be written
        try:
            write_json_atomic(args.json, {"reruns": reruns})
        except OSError as err:
            raise UserError(f"cannot write --json {args.json}: {err.strerror or err}") from None
    failed = 0
    for path in args.records:
        old = read_record(path, warn=False)  # read_record's warning speaks of a run to redo; here it is an error
        if old is None:
            why = "no such file" if not Path(path).exists() else "not a run record (unreadable, or without its fields)"
            raise UserError(f"{path}: {why}; rerun takes the JSON records under <results>/<family>/runs/")
        family = get_family(old["family"])
        options = {**family.run_options(args), "device": args.device, "heartbeat_s": 60.0}
        if old.get("data_source") and options.get("data") and old["data_source"] != options["data"]:
            print(f"note: {path} was made from {old['data_source']}; re-running on {options['data']}", file=sys.stderr)
        cell = Cell(old["family"], old["name"], old["config"], options)
        threads = old.get("timings", {}).get("threads")
        print(
            f"re-running {old['name']} ({old['family']}, {threads} thread(s), recorded by {old['code_version']})",
            flush=True,
        )
        new = execute_cell(cell, threads)
        diffs = record_differences(old, new)
        if diffs:  # another CPU model rounds differently; say which made each
            there, here = old.get("host"), new["host"]
            made = f"{there['cpu']} ({there['isa']})" if there else "a CPU the record does not name"
            print(
                f"  recorded on {made}; re-run on {here['cpu']} ({here['isa']})"
                + (", the same" if there == here else "")
            )
        shared = len(set(old.get("metrics", {}))) + len(set(old.get("curves", {})))
        print(
            f"  {'identical' if not diffs else 'DIFFERENT'}: {shared} metrics and curves compared"
            + (f"; differ: {', '.join(diffs)}" if diffs else "")
        )
        failed += bool(diffs)
        if args.json:
            reruns.append(
                {
                    "record": Path(path).as_posix(),
                    "identical": not diffs,
                    "compared": shared,
                    "differences": diffs,
                    "recorded": {"code_version": old["code_version"], "host": old.get("host")},
                    "rerun": new,
                }
            )
            write_json_atomic(args.json, {"reruns": reruns})
    return 1 if failed else 0


def _cmd_report(args: argparse.Namespace) -> int:
    return report_folder(args.dir, args.beside, args.leave_out_unplanned, getattr(args, "readme", None))


def report_folder(folder: str, beside: list[str], leave_out_unplanned: bool, readme: str | None = None) -> int:
    """Rebuild every summary of a results folder (or of one family's folder) from its records, then REPORT.md
    (with the folders beside it) and, if readme names one, that README's findings block."""
    from .report.document import load_records, rebuild_all, rebuild_family

    where = Path(folder)
    if not where.is_dir():
        raise UserError(f"{folder} is not a folder (expected a results folder with <family>/runs inside, e.g. results)")
    if not any((where / name / "runs").is_dir() for name in family_names()):
        if not (where / "runs").is_dir():
            raise UserError(
                f"{folder} holds no run records: expected a results folder with <family>/runs inside "
                f"({', '.join(family_names())}; e.g. results) or one family's folder with runs/ inside "
                "(e.g. results/grok)"
            )
        # one family's folder (what --out of a family command names): rebuild its summaries
        names = {r["family"] for r in load_records(where / "runs")} or {where.name}
        if len(names) != 1 or not names <= set(family_names()):
            raise UserError(f"{where / 'runs'} holds records of {', '.join(sorted(names))}: expected one family's")
        family = get_family(names.pop())
        for path in rebuild_family(where, family, leave_out_unplanned):
            print(f"wrote {path}")
        print(f"REPORT.md covers a whole results folder: stiefel-attention report {where.parent.as_posix()}")
        return 0
    for other in beside:
        if not Path(other).is_dir() or Path(other).resolve() == where.resolve():
            raise UserError(f"--beside {other}: expected another results folder (e.g. results), next to {folder}")
    for path in rebuild_all(where, beside, leave_out_unplanned):
        print(f"wrote {path}")
    if readme:  # reproduce's report writes no README
        from .report.document import write_findings

        print(f"wrote {write_findings(readme, where)} (its findings block)")
    return 0


def _add_leave_out(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--leave-out-unplanned",
        action="store_true",
        help="report even if some records are cells no experiment of this code plans (an earlier protocol's, or "
        "a non-default option's); REPORT.md names them. Without it such a report is refused",
    )


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """Where and how runs execute; shared by every command that trains."""
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument(
        "--executor",
        default="local",
        choices=("local", "ray"),
        help="local: a process pool on this machine (default); ray: one Ray task per run",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="local executor: parallel runs (default: one per core; 1 runs in this process)",
    )
    p.add_argument(
        "--ray-address", default=None, help="Ray cluster to join (default: $RAY_ADDRESS, else a new local cluster)"
    )
    p.add_argument(
        "--ray-cpus-per-task", type=float, default=1, help="CPUs per run, also its torch threads (default 1)"
    )
    p.add_argument("--ray-gpus-per-task", type=float, default=0, help="GPUs per run (default 0; 1 for one GPU per run)")
    p.add_argument(
        "--retries", type=int, default=2, help="ray: resubmit a failed or killed run up to N times (default 2)"
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (for logs): a line per finished run, and each long run's progress every 10 minutes",
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("stiefel-attention")
    except PackageNotFoundError:
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stiefel-attention", description="Stiefel attention: library and benchmark suite."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("certify", help="certify the propositions numerically in float64")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--seed", type=int, default=0, help="seed of the random instances (default 0)")
    p.set_defaults(func=_cmd_certify)

    p = sub.add_parser("demo", help="a tiny training run: adamw vs stiefel-adam on synthetic images")
    p.add_argument("--steps", type=int, default=60, help="training steps per arm (default 60)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, the initial weights and the order")
    p.add_argument("--device", default=None, help="torch device (default cpu), e.g. cuda")
    p.set_defaults(func=_cmd_demo)

    try:
        families = all_families()
    except ImportError as err:  # only the library is installed: the suite's commands say what to install
        for name in (*FAMILY_MODULES, "reproduce", "rerun", "report"):
            # prefix_chars: take every option as a plain word, so any arguments reach the hint
            p = sub.add_parser(name, help="needs: pip install 'stiefel-attention[bench]'", prefix_chars="\0")
            p.add_argument("rest", nargs="*")
            p.set_defaults(func=lambda args, missing=err.name: _needs_bench(missing))
        return parser
    p = sub.add_parser("list", help="families, their experiments (what each answers), arms, planned runs and time")
    p.add_argument("family", nargs="?", choices=[f.name for f in families], help="only this family")
    p.set_defaults(func=_cmd_list)
    for family in families:
        p = sub.add_parser(family.name, help=family.help)
        p.add_argument(
            "--experiment",
            required=True,
            choices=family.experiments,
            metavar="{" + ",".join(family.experiments) + "}",
            help="; ".join(f"{e}: {family.experiment_help.get(e, '')}" for e in family.experiments),
        )
        p.add_argument(
            "--profile",
            default="smoke",
            choices=list(family.profiles),
            help="model/training size (default smoke, as reproduce's: minutes, into results-smoke/; cpu writes the "
            "committed results/)",
        )
        p.add_argument(
            "--seeds",
            type=parse_seeds,
            default=None,
            help="paired seeds: a count N (0..N-1), a range (0-4) or a list (5,7) (default: the experiment's protocol)",
        )
        p.add_argument(
            "--arms",
            default=None,
            help="run only these arms of the experiment (comma-separated; default all); "
            "the summary still covers every finished run of the experiment",
        )
        p.add_argument(
            "--out",
            default=None,
            help=f"results folder; runs/ inside is shared by experiments (default: "
            f"results/{family.name} for the cpu profile, results-PROFILE/{family.name} otherwise)",
        )
        p.add_argument(
            "--set",
            type=parse_setting,
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="change a setting of every run (repeatable; dotted for nested keys: --set steps=600 --set "
            "model.d_model=128): it is part of each run's config and key; a results folder of its own (--out) "
            "keeps such runs apart from the default settings' records",
        )
        family.add_arguments(p)
        _add_run_args(p)
        p.set_defaults(func=_family_command)

    p = sub.add_parser("reproduce", help="certify, run every experiment of every family, write the report")
    p.add_argument(
        "--profile",
        default="smoke",
        choices=["smoke", "cpu", "paper"],
        help="model/training size (default smoke: minutes)",
    )
    p.add_argument(
        "--out", default=None, help="results folder (default: results for the cpu profile, results-PROFILE otherwise)"
    )
    for family in families:
        family.add_reproduce_arguments(p)
    _add_leave_out(p)
    _add_run_args(p)
    p.set_defaults(func=_cmd_reproduce)

    p = sub.add_parser("rerun", help="re-run recorded runs and check that they reproduce exactly")
    p.add_argument("records", nargs="+", help="run record files (e.g. results/cifar/runs/adamw-s0-n10000-*.json)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument(
        "--json",
        metavar="PATH",
        help="also write each comparison (both hosts and code versions, what differs, the re-run's whole record) "
        "to PATH, rewritten as each re-run finishes",
    )
    for family in families:
        family.add_reproduce_arguments(p)
    p.set_defaults(func=_cmd_rerun)

    p = sub.add_parser("report", help="rebuild every summary, plot and REPORT.md from the run records")
    p.add_argument("dir", nargs="?", default="results", help="results folder (default: results)")
    p.add_argument(
        "--beside",
        action="append",
        default=[],
        metavar="DIR",
        help="another profile's results folder (repeatable): REPORT.md's 'When does the geometry dominate?' sets its "
        "rows beside this folder's and compares each standing (its summaries are read, not rebuilt)",
    )
    p.add_argument(
        "--readme",
        metavar="PATH",
        help="also write what was found, computed from the summaries, between PATH's findings markers "
        "(README.md's block)",
    )
    _add_leave_out(p)
    p.set_defaults(func=_cmd_report)
    return parser


def _needs_bench(missing: str | None) -> int:
    raise UserError(
        f"the benchmark suite needs {missing or 'its dependencies'}: pip install 'stiefel-attention[bench]'"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted; finished runs are on disk", file=sys.stderr)
        return 130
    except (UserError, ValueError, OSError) as err:
        if os.environ.get("STIEFEL_ATTENTION_DEBUG"):
            raise
        print(f"stiefel-attention {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
