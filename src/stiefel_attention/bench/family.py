"""The experiment-family interface, and the registry that runner, report and CLI look families up in.

A family (CIFAR-10 patches, grokking, ...) is one module that defines a `Family` subclass and a
module-level `FAMILY` instance: its profiles and named experiments, the cells of each experiment,
how one cell runs, and how an experiment's records become a summary, markdown, plots and claim
rows. Nothing outside a family's own module branches on its name. The suite's own families are the
modules of FAMILY_MODULES; a testbed defined anywhere else joins them with `register_family`
(docs/benchmarks.md, "Adding a testbed").
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from .errors import DataError, NotReady, UserError
from .records import Cell

if TYPE_CHECKING:  # the report layer's record, named here for the annotation only
    from .report.summaries import MechanismAnswer

__all__ = [
    "Family",
    "FAMILY_MODULES",
    "NotReady",
    "Plan",
    "UserError",
    "all_families",
    "check_data",
    "data_of",
    "family_names",
    "get_family",
    "register_family",
    "unregister_family",
    "with_data",
]

# The registered families, in the order `reproduce` runs them and REPORT.md lists them.
FAMILY_MODULES = ("cifar", "grok", "lm", "mqar", "pretrained")


class Plan(NamedTuple):
    """How far an experiment's default plan has got: its finished cells, of all the cells it plans, and per arm
    (arm, finished, planned) in the plan's order, so that a plan run arm by arm (--arms) says which arms ran."""

    done: int
    total: int
    by_arm: tuple[tuple[str, int, int], ...] = ()


class Family:
    """One experiment family. Subclasses set the class attributes and implement the methods."""

    name: str  # the `family` of its cells and records; also its CLI command and results folder
    title: str  # the testbed in words, for REPORT.md
    help: str  # one line for the CLI
    profiles: dict[str, dict]  # model/training sizes: at least "smoke", "cpu", "paper"
    experiments: tuple[str, ...]  # named experiments, each a set of cells
    experiment_help: dict[str, str] = {}  # each experiment: one line on the question it answers (CLI, `list`)
    claimed: tuple[str, ...] = ()  # experiments whose summaries carry paper claims (REPORT.md lists them)
    progress_unit: str = "step"  # what run(progress=...) counts, for the heartbeat line of a long run
    resumable: bool = False  # run(checkpoint=...) saves its state while in flight and resumes from it (partial.py)
    reproduce_order: tuple[str, ...] = ()  # experiments `reproduce` runs, in this order (default: all)
    controls_experiment: str | None = None  # its experiment with every arm (REPORT: "When does the geometry dominate?")
    decay_experiment: str | None = None  # its stiefel-adam vs adamw lead against weight decay, if it has one
    mechanism_experiment: str | None = None  # its interventions on the mechanism (REPORT: "The mechanism")
    factorial_experiments: tuple[str, ...] = ()  # its geometry x optimizer tables (REPORT: "Geometry or optimizer?")
    # sha256 of the data its committed results were made from (None: the family generates its data). Cells of
    # that data have no data entry in their config, so those records keep their keys; other data adds one.
    default_data_sha256: str | None = None

    # --- planning ---------------------------------------------------------------------------
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Family-specific CLI options (beyond --experiment, --profile, --seeds, --out)."""

    def cells(self, experiment: str, profile: str, seeds: int | None = None, **options: Any) -> list[Cell]:
        """The runs of one experiment; seeds None means the experiment's default."""
        raise NotImplementedError

    def cell_options(self, args: argparse.Namespace) -> dict[str, Any]:
        """What the family's CLI options add to `cells(...)` (e.g. a training-set size)."""
        return {}

    def run_options(self, args: argparse.Namespace | None) -> dict[str, Any]:
        """Where to run, not what (e.g. a data source), checked now: raises UserError with one clear line."""
        return {}

    def add_reproduce_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Options of `reproduce` that this family needs (e.g. where its data is)."""

    def data_sha256(self, run_options: dict[str, Any]) -> str | None:
        """Content hash of the data the run options point at (None for generated data)."""
        return None

    def data_key(self, run_options: dict[str, Any]) -> dict[str, str]:
        """What the data adds to each cell's config: {} for the default data, else {"data_sha256": ...}."""
        sha = self.data_sha256(run_options)
        return {} if sha is None or sha == self.default_data_sha256 else {"data_sha256": sha}

    def describe(self, run_options: dict[str, Any]) -> str:
        """A few words on the run options for the CLI's first line (e.g. the data source)."""
        return ""

    def plan_note(self, experiment: str, profile: str) -> str:
        """What the CLI adds about runs the experiment will plan later ("" when none), e.g. a sweep's stage."""
        return ""

    # --- running ------------------------------------------------------------------------------
    def run(self, config: dict, progress=None, **options: Any) -> dict:
        """Train one cell; return its metrics, curves and timings (the runner adds config and provenance)."""
        raise NotImplementedError

    # --- reporting ----------------------------------------------------------------------------
    def experiment_records(self, experiment: str, profile: str, by_key: dict[str, dict]) -> list[dict]:
        """The records (among by_key, every record of this family and profile) that make up one experiment."""
        seeds = 1 + max((r["config"]["seed"] for r in by_key.values()), default=-1)
        try:
            planned = with_data(self.cells(experiment, profile, max(seeds, 1)), data_of(by_key.values()))
        except NotReady:
            return []
        return [by_key[c.key] for c in planned if c.key in by_key]

    def plan(self, experiment: str, profile: str, finished: list[dict]) -> Plan:
        """How many of the cells the experiment plans by default are among the finished records ('k of n runs').

        The records of an experiment may hold more than its plan (another experiment's extra seeds of a shared
        cell), so k counts planned cells, not records.
        """
        cells = with_data(self.cells(experiment, profile), data_of(finished))
        keys = {r["key"] for r in finished}
        arms: dict[str, list[int]] = {}
        for c in cells:
            count = arms.setdefault(c.config.get("arm", ""), [0, 0])
            count[0] += c.key in keys
            count[1] += 1
        planned = {c.key for c in cells}
        by_arm = tuple((arm, done, total) for arm, (done, total) in arms.items())
        return Plan(len(planned & keys), len(planned), by_arm)

    def write_summary(
        self,
        out_dir: Path,
        experiment: str,
        records: list[dict],
        profile: str,
        plan: Plan | None,
        by_key: dict[str, dict],
    ) -> dict:
        """summary.json, summary.md and plots under out_dir/<experiment>/; returns the summary."""
        raise NotImplementedError

    def claim_rows(self, experiment: str, summary: dict, link: str, profile: str) -> list[tuple[str, ...]]:
        """REPORT.md rows (link, profile, claim, measured, verdict) from one experiment's summary."""
        return []

    def mechanism_answer(self, experiment: str, summary: dict) -> MechanismAnswer | None:
        """This family's part of REPORT's "The mechanism" section, read from its own summary of its
        mechanism_experiment (None: it has none)."""
        return None


def check_data(config: dict, default_sha256: str, sha256: str, source: str) -> None:
    """Refuse (DataError) to run a cell on data other than its config names: its record is keyed by that data."""
    expected = config.get("data_sha256", default_sha256)
    if sha256 != expected:
        raise DataError(
            f"this run ({config.get('arm')}, seed {config.get('seed')}) is keyed to data with sha256 "
            f"{expected[:12]}..., but {source} has sha256 {sha256[:12]}...; give it the data it was planned for"
        )


def data_of(records) -> dict:
    """What the records' configs share beyond the plan: their data entry (none for a family's default data) and
    their settings (`--set`; none for the profile's own). A folder holds one dataset and one set of settings."""
    records = list(records)
    shas = {r.get("config", {}).get("data_sha256") for r in records} - {None}
    if len(shas) > 1:
        raise ValueError(f"records of {len(shas)} different datasets ({', '.join(sorted(s[:12] for s in shas))}) mixed")
    settings = {json.dumps(r.get("config", {}).get("settings"), sort_keys=True) for r in records}
    if len(settings) > 1:
        raise ValueError(
            f"records of {len(settings)} different --set settings in one folder ({'; '.join(sorted(settings))}): "
            "keep one set of settings per results folder (--out DIR)"
        )
    shared = {"data_sha256": shas.pop()} if shas else {}
    if settings and (chosen := json.loads(settings.pop())) is not None:
        shared["settings"] = chosen
    return shared


def _fits(old: Any, new: Any) -> bool:
    """Whether new may replace old in a config: the same JSON type (an int where a float was; a number where
    None was, as in an unset max_step)."""
    if isinstance(old, bool) or isinstance(new, bool):
        return isinstance(old, bool) and isinstance(new, bool)
    if old is None:
        return new is None or isinstance(new, (int, float, str))
    if isinstance(old, float):
        return isinstance(new, (int, float))
    if isinstance(old, list):
        return isinstance(new, list) and len(new) == len(old) and all(map(_fits, old, new))
    return type(new) is type(old)


def with_settings(name: str, config: dict, settings: dict[str, Any]) -> dict:
    """config with each dotted key of settings set to its value, and the settings themselves recorded (so both
    are in the key). A key the config lacks, or a value of another type, is refused naming what there is."""
    out = copy.deepcopy(config)
    for dotted, value in settings.items():
        *parents, leaf = dotted.split(".")
        where = out
        for part in parents:
            where = where.get(part) if isinstance(where, dict) else None
        if not isinstance(where, dict) or leaf not in where or leaf == "settings":
            known = sorted(
                f"{k}.{sub}" if isinstance(v, dict) else k
                for k, v in config.items()
                for sub in (v if isinstance(v, dict) else [k])
            )
            raise ValueError(f"--set {dotted}: {name}'s config has no {dotted}; its keys are {', '.join(known)}")
        old = where[leaf]
        if not _fits(old, value):
            raise ValueError(
                f"--set {dotted}={value!r}: {name}'s {dotted} is {old!r} ({type(old).__name__}); "
                "give a value of that type"
            )
        where[leaf] = float(value) if isinstance(old, float) else value
    out["settings"] = dict(settings)
    return out


def with_data(cells: list[Cell], data: dict) -> list[Cell]:
    """The cells with the data entry (and any --set settings) added to their configs, and so to their keys;
    unchanged for {}."""
    if not data:
        return cells
    data = dict(data)
    settings = data.pop("settings", None)
    return [
        Cell(
            c.family,
            c.name,
            with_settings(c.name, {**c.config, **data}, settings) if settings else {**c.config, **data},
            c.options,
        )  # fmt: skip
        for c in cells
    ]


_REGISTERED: dict[str, Family] = {}  # testbeds defined outside this package, for this process


def register_family(family: Family) -> Family:
    """Make a Family defined outside this package a testbed of this process: its command, `list`, `report`
    and `reproduce` then treat it as one of the suite's. A name already taken, or a family without the
    attributes every family sets, is refused."""
    missing = [a for a in ("name", "title", "help", "profiles", "experiments") if not getattr(family, a, None)]
    if missing:
        raise ValueError(f"a family must set {', '.join(missing)} (see bench.family.Family)")
    if family.name in family_names():
        raise ValueError(f"a family named {family.name!r} exists already; families: {', '.join(family_names())}")
    _REGISTERED[family.name] = family
    return family


def unregister_family(name: str) -> None:
    """Remove a family that `register_family` added (the suite's own stay)."""
    if name not in _REGISTERED:
        raise ValueError(f"{name!r} was not added by register_family; added: {', '.join(_REGISTERED) or 'none'}")
    del _REGISTERED[name]


def family_names() -> tuple[str, ...]:
    """Every family's name: the suite's own, then those registered in this process."""
    return (*FAMILY_MODULES, *_REGISTERED)


def get_family(name: str) -> Family:
    """The family of that name; a clear error naming every family otherwise."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in FAMILY_MODULES:
        raise ValueError(f"unknown experiment family {name!r}; registered: {', '.join(family_names())}")
    return importlib.import_module(f"{__package__}.{name}").FAMILY


def all_families() -> list[Family]:
    return [get_family(name) for name in family_names()]
