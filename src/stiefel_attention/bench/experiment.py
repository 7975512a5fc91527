"""One experiment run from a request: the request (a dataclass the command line and `reproduce` fill), its
preflight (every check that needs no run), and its run, from the cells to the records and the experiment's
summary. The command line only maps flags to requests (cli.py); nothing here reads argv or a Namespace."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .family import FAMILY_MODULES, Family, UserError, with_data
from .records import Cell

__all__ = [
    "RunRequest",
    "check_device",
    "check_folder_for",
    "default_results_dir",
    "preflight",
    "run_experiment",
]


def default_results_dir(profile: str) -> Path:
    """`results` holds the committed cpu-profile records; other profiles get their own folder, so a
    smoke run can never mix its records into (or overwrite the summaries of) the measured ones."""
    return Path("results") if profile == "cpu" else Path(f"results-{profile}")


def check_folder_for(family, runs_dir: Path, profile: str, run_options: dict) -> None:
    """Before any run: the folder can take records, and holds (or is running) only this profile and data."""
    from .lock import Claims
    from .records import ensure_writable
    from .runner import check_folder

    ensure_writable(runs_dir)
    hint = f" (default {default_results_dir(profile)})"
    data = family.data_key(run_options).get("data_sha256")
    claims = Claims(runs_dir)
    with claims.folder():
        check_folder(runs_dir, profile, data, run_options.get("data"), claims, hint)


def check_reportable(family, out: Path, cells: list, what: str) -> None:
    """Before any run: `report` on the folder will take every record these cells write, rather than leave it out
    (cells of a non-default option, such as cifar's --n, beside the records of the default's)."""
    from .report.document import place_records

    mine = {c.key for c in cells}
    left = [r["name"] for r in place_records(out, family, cells).unplaced if r["key"] in mine]
    if left:
        raise UserError(
            f"{what}: {len(left)} of its {len(cells)} runs (e.g. {left[0]}) would be records that no summary of "
            f"{out} takes, beside the records there of the same experiment at its default settings (which `report` "
            "reports); run them into a results folder of their own (--out DIR), where they are that experiment"
        )


def check_device(device: str | None) -> None:
    """--device names a device this machine has: checked once, before any run, not by every run failing."""
    if device is None:
        return
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, ValueError) as err:
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"--device {device!r} cannot be used here: {why}") from None


def chosen_arms(arms: str | None, cells: list, what: str) -> list[str]:
    """The arms of --arms (comma-separated), each checked against the experiment's; [] means all."""
    if not arms:
        return []
    chosen = [a.strip() for a in arms.split(",") if a.strip()]
    known = list(dict.fromkeys(c.config["arm"] for c in cells))
    unknown = [a for a in chosen if a not in known]
    if unknown or not chosen:
        raise UserError(
            f"--arms {arms!r}: {what} has no arm {', '.join(unknown) or '(none given)'}; "
            f"its arms are {', '.join(known)}"
        )
    return chosen


@dataclass(frozen=True)
class RunRequest:
    """One experiment to run, as a command asked for it (a family's command, or reproduce for each experiment):
    everything from the command line that the run needs, checked where it could be before any run."""

    family: Family
    experiment: str
    profile: str
    out: Path  # the family's results folder; records go to out/runs
    run_options: dict  # where to run, not what (the family's data source), checked by family.run_options
    executor: Any  # runner's LocalExecutor, InlineExecutor or RayExecutor
    seeds: int | tuple[int, ...] | None = None  # a count, listed seeds, or the experiment's protocol
    arms: str | None = None  # --arms as given (comma-separated), checked against the experiment's arms
    settings: dict = field(default_factory=dict)  # --set, in every run's config
    cell_options: dict = field(default_factory=dict)  # the family's planning options (cifar's --n)
    device: str | None = None
    progress: bool = True


def seed_cells(request: RunRequest) -> list:
    """The experiment's cells for the request's seeds: a count is the family's own; listed seeds are the cells of
    seeds 0..max whose seed is listed, so a listed seed's run is the very run (same key) a count would plan."""
    family, seeds = request.family, request.seeds
    if not isinstance(seeds, tuple):
        return family.cells(request.experiment, request.profile, seeds, **request.cell_options)
    cells = family.cells(request.experiment, request.profile, 1 + max(seeds), **request.cell_options)
    chosen = [c for c in cells if c.config.get("seed") in seeds]
    if not chosen:
        have = sorted({c.config.get("seed") for c in cells})
        raise UserError(f"--seeds: {family.name} {request.experiment} has no run of seeds {seeds} (it has {have})")
    return chosen


def preflight(request: RunRequest) -> tuple[list[Cell], list[Cell], list[str]]:
    """Every check that needs no run, before any: the family can run in this executor, the seeds and arms exist,
    the folder takes records of this profile and data, and `report` will take every record the cells write.
    Returns the experiment's cells at the request's seeds and settings, those to run (--arms applied) and the
    chosen arms ([]: all)."""
    from .runner import InlineExecutor

    family, out = request.family, request.out
    if family.name not in FAMILY_MODULES and not isinstance(request.executor, InlineExecutor):
        raise UserError(
            f"{family.name} was added by register_family in this process, and worker processes start without it: "
            "run it with --jobs 1 (in this process)"
        )
    what = f"{family.name} --experiment {request.experiment}"
    cells = with_data(seed_cells(request), {"settings": request.settings} if request.settings else {})
    chosen = chosen_arms(request.arms, cells, what)
    cells = with_data(cells, family.data_key(request.run_options))
    check_folder_for(family, out / "runs", request.profile, request.run_options)
    check_reportable(family, out, cells, what)
    # each long run says how far it is: every minute beside a bar, every 10 minutes in a log (--no-progress)
    options = {**request.run_options, "device": request.device, "heartbeat_s": 60.0 if request.progress else 600.0}
    cells = [type(c)(c.family, c.name, c.config, options) for c in cells]
    to_run = [c for c in cells if not chosen or c.config["arm"] in chosen]
    return cells, to_run, chosen


def run_experiment(request: RunRequest) -> int:
    """Run the request's missing cells after its preflight, then write the experiment's summary of the folder, as
    `report` writes it; 1 if a run failed."""
    from .report.document import load_records
    from .runner import run_cells

    family, out = request.family, request.out
    cells, to_run, chosen = preflight(request)
    print(run_count_header(request, cells, to_run, chosen, family.describe(request.run_options)))
    if note := family.plan_note(request.experiment, request.profile):
        print(f"note: {note}")
    _, failures = run_cells(
        to_run, out / "runs", request.executor, progress=request.progress, desc=f"{family.name} {request.experiment}"
    )
    # the folder's summary of the experiment, as `report` writes it (it takes every record of these cells: checked)
    by_key = {r["key"]: r for r in load_records(out / "runs", family.name)}
    finished = family.experiment_records(request.experiment, request.profile, by_key)
    plan = family.plan(request.experiment, request.profile, finished)
    family.write_summary(out, request.experiment, finished, request.profile, plan, by_key)
    print((out / request.experiment / "summary.md").read_text())
    for cell, err in failures:
        print(f"FAILED {cell.name}: {type(err).__name__}: {err}", file=sys.stderr)
    return 1 if failures else 0


def run_count_header(request: RunRequest, cells: list, to_run: list, chosen: list[str], about: str) -> str:
    """What this command will run: the runs selected (--arms, --seeds applied), how many of them are already
    recorded, and what the selection leaves out of the experiment."""
    runs = request.out / "runs"
    done = sum(c.path(runs).is_file() for c in to_run)
    parts = [f"{request.family.name} {request.experiment}: {len(to_run)} runs (profile {request.profile})"]
    if done:
        parts.append(f"{done} already recorded, {len(to_run) - done} to run")
    if about:
        parts.append(about)
    if chosen:
        parts.append(f"arms {', '.join(chosen)} only (the experiment has {len(cells)} runs at these seeds)")
    if isinstance(request.seeds, tuple):
        parts.append(f"seeds {', '.join(map(str, request.seeds))}")
    return ", ".join(parts) + f", records in {runs}"
