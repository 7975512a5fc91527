"""Execute experiment cells, one JSON record per finished run, resumable.

A cell whose record (`records.py`) exists is skipped; a record is written atomically the moment
its run finishes, so Ctrl-C or a crash loses only runs in flight, and of a resumable family's runs only the
steps since their last checkpoint (`partial.py`). Executors are a small interface:
`LocalExecutor` (a process pool, one process per core by default), `InlineExecutor` (this process;
tests and debugging) and `RayExecutor` (one Ray task per run, on a local or remote Ray cluster). An executor needs only
`submit(cells, runs_dir) -> iterator of (cell, record or exception)`.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from .errors import UserError
from .family import get_family
from .lock import Claims
from .partial import Checkpoint, checkpoint_path
from .records import Cell, code_version, ensure_writable, read_record, write_json_atomic

__all__ = [
    "Executor",
    "InlineExecutor",
    "LocalExecutor",
    "RayExecutor",
    "RayNotInstalled",
    "check_folder",
    "execute_cell",
    "record_differences",
    "host",
    "run_cells",
]


class Heartbeat:
    """Progress of one long run as a line on stderr at most every `every_s` seconds: how far, how fast since this
    process took it up (a resumed run starts part-way), and about how long is left.

    Pool workers cannot draw into the parent's progress bar; a 15-minute run should still say
    that it is alive and how far it got.
    """

    def __init__(self, name: str, every_s: float, unit: str = "step", clock=time.perf_counter):
        self.name, self.every_s, self.unit, self.clock = name, every_s, unit, clock
        self.last = clock()
        self.start: tuple[float, int] | None = None  # (time, count) of the first report: the rate's origin

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if self.start is None:
            self.start = (now, done)
        if now - self.last >= self.every_s or done == total:
            self.last = now
            line = f"  {self.name}: {self.unit} {done}/{total} ({100 * done / max(total, 1):.0f}%)"
            seconds, count = now - self.start[0], done - self.start[1]
            if seconds > 0 and count > 0:
                rate = count / seconds
                line += f", {rate:.3g} {self.unit}s/s"
                line += f", about {(total - done) / rate / 60:.0f} min left" if done < total else ""
            print(line, file=sys.stderr, flush=True)


def host() -> dict:
    """The CPU a record is made on: another CPU model's vectorised kernels round differently (about 1e-7)."""
    import platform

    import torch

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return {"cpu": model, "isa": torch.backends.cpu.get_cpu_capability()}


def execute_cell(cell: Cell, threads: int | None = None) -> dict:
    """Run one cell in this process and return its record (config, metrics, curves, timings)."""
    import torch

    version = code_version()
    family = get_family(cell.family)
    threads_before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    # Denormals slow small-gradient training several-fold on CPUs. Flushing them is a process-wide
    # switch (torch has no getter), so it is switched back off for the caller afterwards.
    torch.set_flush_denormal(True)
    options = dict(cell.options)
    heartbeat_s = options.pop("heartbeat_s", None)
    if heartbeat_s:
        options["progress"] = Heartbeat(cell.name, heartbeat_s, family.progress_unit)
    runs_dir, every_s = options.pop("checkpoint_dir", None), options.pop("checkpoint_every_s", 300.0)
    checkpoint = None
    if runs_dir is not None and family.resumable:
        stretch = {"code_version": version, **host(), "threads": torch.get_num_threads()}
        checkpoint = Checkpoint(checkpoint_path(runs_dir, cell.name, cell.key), cell.key, stretch, every_s)
        options["checkpoint"] = checkpoint
    try:
        result = family.run(cell.config, **options)
    except Exception as err:
        if checkpoint is not None:  # a checkpoint the failed run resumed from is not kept to fail the next one
            checkpoint.discard(err)
        raise
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads_before)
    if checkpoint is not None and checkpoint.resumed():
        result = {**result, "resumed": checkpoint.resumed()}
    return {
        "name": cell.name,
        "key": cell.key,
        "family": cell.family,
        "config": cell.config,
        "code_version": version,
        "torch": torch.__version__,
        "host": host(),
        **result,
    }


class Executor(Protocol):
    """Runs cells and yields (cell, record or exception) as each finishes, in any order.

    runs_dir is where run_cells will write the records; an executor whose workers can reach it may
    write them there first (run_cells writes them again, atomically and with the same content).
    """

    def submit(
        self, cells: list[Cell], runs_dir: Path | None = None
    ) -> Iterator[tuple[Cell, dict | BaseException]]: ...


class InlineExecutor:
    """Runs cells one after another in this process."""

    def __init__(self, threads: int | None = None):
        self.threads = threads

    def submit(self, cells, runs_dir=None):
        for cell in cells:
            try:
                yield cell, execute_cell(cell, self.threads)
            except KeyboardInterrupt:
                raise
            except Exception as err:  # reported by run_cells, the other cells go on
                err.details = traceback.format_exc()  # type: ignore[attr-defined]
                yield cell, err


def _exit_when_orphaned(parent: int) -> None:
    """A pool worker whose parent died (kill, closed terminal) stops too, instead of training on."""
    import threading

    def watch():
        while True:
            time.sleep(2.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _execute_in_worker(cell: Cell, threads: int, parent: int) -> dict:
    _exit_when_orphaned(parent)
    return execute_cell(cell, threads)


class LocalExecutor:
    """A pool of `jobs` processes, each with cores // jobs torch threads (independent seeds in parallel)."""

    def __init__(self, jobs: int | None = None):
        cores = os.cpu_count() or 1
        self.jobs = max(1, jobs or cores)
        self.threads = max(1, cores // self.jobs)

    def submit(self, cells, runs_dir=None):
        """Keeps `jobs` cells in flight, taking the next from `cells` only when one finishes (so that a lazy
        iterable, e.g. run_cells' claims, claims no cell before a worker is free for it)."""
        cells = iter(cells)
        first = list(itertools.islice(cells, self.jobs))
        if not first:
            return
        ctx = mp.get_context("spawn")  # no forked torch thread pools
        pool = cf.ProcessPoolExecutor(max_workers=len(first), mp_context=ctx)
        try:
            futures = {pool.submit(_execute_in_worker, cell, self.threads, os.getpid()): cell for cell in first}
            while futures:
                finished, _ = cf.wait(futures, return_when=cf.FIRST_COMPLETED)
                for fut in finished:
                    cell = futures.pop(fut)
                    try:
                        outcome = fut.result()
                    except Exception as err:
                        outcome = err
                    yield cell, outcome
                    for nxt in itertools.islice(cells, 1):
                        futures[pool.submit(_execute_in_worker, nxt, self.threads, os.getpid())] = nxt
        except BaseException:  # Ctrl-C or SIGINT to this process alone, or the consumer stopping
            # The workers did not get the signal (it went to this process only): stop them now
            # instead of letting them train to the end for results nobody will write.
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                proc.terminate()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


class RayNotInstalled(RuntimeError):
    """--executor ray without Ray installed."""


def _run_cell_task(cell: Cell, threads: int, runs_dir: str | None) -> dict:
    """Body of one Ray task: run the cell and write its record where the driver will look for it.

    A record already on disk means an earlier attempt finished and then lost its worker before the
    driver heard back: return that record instead of training again (finished work is never redone).
    """
    path = cell.path(runs_dir) if runs_dir else None
    done = read_record(path) if path is not None else None
    if done is not None:
        return done
    record = execute_cell(cell, threads)
    if path is not None:
        try:
            write_json_atomic(path, record)
        except OSError:  # a worker without the driver's filesystem; the driver writes the record
            pass
    return record


class RayExecutor:
    """One Ray task per run, on the cluster at `address` (or $RAY_ADDRESS; else a new local one).

    Each task asks for `cpus_per_task` CPUs (also its torch thread count) and `gpus_per_task` GPUs.
    Workers write each record into runs_dir as soon as the run finishes (when they share the
    driver's filesystem), so a driver that dies loses nothing finished. A task that fails or whose
    worker is killed is resubmitted up to `retries` times, and every retry is reported on stderr and
    kept in `self.retried`; after that its last error is yielded like any failure. Records are keyed
    by config, so a retry can never produce a second record.
    """

    def __init__(
        self,
        address: str | None = None,
        cpus_per_task: float = 1,
        gpus_per_task: float = 0,
        retries: int = 2,
        init_kwargs: dict | None = None,
    ):
        if cpus_per_task <= 0 or gpus_per_task < 0 or retries < 0:
            raise ValueError("cpus_per_task must be > 0, gpus_per_task and retries >= 0")
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        self.cpus_per_task, self.gpus_per_task, self.retries = cpus_per_task, gpus_per_task, retries
        self.init_kwargs = init_kwargs or {}
        self.retried: list[tuple[str, int, str]] = []  # (cell name, attempt that failed, error)

    @staticmethod
    def import_ray():
        try:
            import ray
        except ImportError:
            raise RayNotInstalled(
                "--executor ray needs Ray: pip install 'stiefel-attention[ray]' "
                "(or pip install ray), then run the command again"
            ) from None
        return ray

    def submit(self, cells, runs_dir=None):
        cells = list(cells)  # every cell at once: Ray schedules them over the cluster
        if not cells:
            return
        ray = self.import_ray()
        if not ray.is_initialized():
            ray.init(address=self.address, include_dashboard=False, logging_level="warning", **self.init_kwargs)
        task = ray.remote(num_cpus=self.cpus_per_task, num_gpus=self.gpus_per_task, max_retries=0)(_run_cell_task)
        threads = max(1, int(self.cpus_per_task))
        # absolute: a Ray worker's working directory is not the driver's
        where = str(Path(runs_dir).resolve()) if runs_dir is not None else None
        in_flight = {task.remote(cell, threads, where): (cell, 1) for cell in cells}
        try:
            while in_flight:
                [ref], _ = ray.wait(list(in_flight), num_returns=1)
                cell, attempt = in_flight.pop(ref)
                try:
                    yield cell, ray.get(ref)
                except ray.exceptions.RayError as err:
                    # RayTaskError: the training code raised; others: the worker or node died.
                    cause = err.cause if isinstance(err, ray.exceptions.RayTaskError) and err.cause is not None else err
                    reason = (
                        f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"
                    )
                    if attempt <= self.retries:
                        self.retried.append((cell.name, attempt, reason))
                        print(
                            f"\nrun {cell.name} failed on attempt {attempt} ({reason}); retrying "
                            f"({attempt}/{self.retries})",
                            file=sys.stderr,
                            flush=True,
                        )
                        in_flight[task.remote(cell, threads, where)] = (cell, attempt + 1)
                    else:
                        if not isinstance(cause, BaseException):
                            cause = RuntimeError(reason)
                        cause.details = f"failed {attempt} times; last: {reason}"  # type: ignore[attr-defined]
                        yield cell, cause
        finally:  # Ctrl-C or the consumer stopping: nothing should train on unobserved
            for ref in in_flight:
                ray.cancel(ref, force=True)


def _signature(config: dict) -> tuple[str, str | None]:
    """What one results folder must not mix: the profile, and the data (None: the family's default)."""
    return config.get("profile", "?"), config.get("data_sha256")


def check_folder(
    runs_dir: str | Path,
    profile: str,
    data_sha256: str | None = None,
    source: str | None = None,
    claims: Claims | None = None,
    hint: str = "",
) -> None:
    """Refuse (UserError) to add runs to a folder that holds records, or runs in flight in another
    process, of another profile or other data: a folder's summaries describe one profile on one dataset.

    data_sha256 None is the family's default data; source names this run's data for the message.
    """
    runs_dir = Path(runs_dir)
    found: dict[tuple, tuple[str, str]] = {}  # signature -> (records or runs in flight, their data source)
    for path in sorted(runs_dir.glob("*.json")):
        record = read_record(path, warn=False)
        if record is not None:
            found.setdefault(_signature(record["config"]), ("records", record.get("data_source") or ""))
    for other in claims.others() if claims is not None else []:
        sig = (other.get("profile", "?"), other.get("data_sha256"))
        who = f"in flight: pid {other.get('pid')} on {other.get('host')} since {other.get('since')}"
        found.setdefault(sig, (who, other.get("source") or ""))
    for (their_profile, their_data), (what, their_source) in found.items():
        if their_profile != profile:
            raise UserError(
                f"{runs_dir} holds runs of profile {their_profile} ({what}), not {profile}; "
                f"use another --out for the {profile} profile{hint}"
            )
        if their_data != data_sha256:
            theirs = f"{their_source or 'its default data'} (sha256 {(their_data or 'default')[:12]})"
            ours = f"{source or 'other data'} (sha256 {(data_sha256 or 'default')[:12]})"
            raise UserError(
                f"{runs_dir} holds runs made from {theirs}, not from {ours}: a results folder holds one "
                "dataset; use another --out for this data"
            )


def resumable(cell: Cell) -> bool:
    """Whether the cell's family saves checkpoints of runs in flight."""
    try:
        return get_family(cell.family).resumable
    except ValueError:  # an unknown family: its run fails in the worker and is reported as that run's failure
        return False


def run_cells(
    cells: list[Cell], runs_dir: str | Path, executor: Executor | None = None, progress: bool = True, desc: str = "runs"
) -> tuple[dict[str, dict], list[tuple[Cell, BaseException]]]:
    """Run every cell whose record is missing; return ({cell.key: record}, failures).

    The folder is created and checked for writing first. Cells are claimed (`lock.py`) one at a time, as
    the executor becomes ready for each (all at once on Ray, which schedules them itself), each claim
    taken under the folder's lock; what the folder holds (one profile, one dataset: `check_folder`) is
    checked there whenever the folder holds neither a claim of this process nor a record of its cells, the
    only times another profile could have come in (it checks too, and sees ours). A cell another live
    process has claimed or finished is left to it, so concurrent commands on one folder split the work
    between them. Records are written the moment each run finishes. Duplicate cells (same key) run once.
    """
    runs_dir = ensure_writable(runs_dir)
    unique = list({c.key: c for c in cells}.values())
    records: dict[str, dict] = {}
    missing: list[Cell] = []
    busy: list[Cell] = []
    claims = Claims(runs_dir)
    signatures = {_signature(c.config) for c in unique}

    def check() -> None:
        if len(signatures) == 1:
            (profile, data_sha256), source = next(iter(signatures)), unique[0].options.get("data")
            check_folder(runs_dir, profile, data_sha256, source, claims)

    with claims.folder():
        check()
        for cell in unique:
            done = read_record(cell.path(runs_dir))
            if done is not None:
                records[cell.key] = done
            else:
                missing.append(cell)
    failures: list[tuple[Cell, BaseException]] = []
    bar = None

    def claimed() -> Iterator[Cell]:
        """The missing cells this process claims, each when the executor asks for the next."""
        for cell in missing:
            about = {
                **dict(zip(("profile", "data_sha256"), _signature(cell.config))),
                "source": cell.options.get("data"),
            }
            with claims.folder():
                if not (claims.held or records):  # no claim or record of our cells marks the folder: look again
                    check()
                ok = claims.claim(cell, about)
            # another process may have finished it since we looked, or holds it now
            done = read_record(cell.path(runs_dir), warn=False)
            if ok and done is None:
                if resumable(cell):  # its checkpoints go beside the records
                    cell = replace(cell, options={**cell.options, "checkpoint_dir": str(runs_dir)})
                yield cell
                continue
            if ok:
                claims.release(cell)
            if done is not None:
                records[cell.key] = done
            else:
                busy.append(cell)
            if bar is not None:
                bar.total -= 1
                bar.refresh()

    if missing:
        executor = executor or LocalExecutor()
        if progress:
            from tqdm import tqdm

            bar = tqdm(
                total=len(missing),
                desc=desc,
                unit="run",
                initial=0,
                dynamic_ncols=True,
                postfix={"done before": len(unique) - len(missing)},
            )
    try:
        for cell, outcome in executor.submit(claimed(), runs_dir) if missing else ():
            if isinstance(outcome, BaseException):
                failures.append((cell, outcome))
                print(f"\nrun {cell.name} failed: {type(outcome).__name__}: {outcome}", file=sys.stderr)
            else:
                write_json_atomic(cell.path(runs_dir), outcome)
                records[cell.key] = outcome
                checkpoint_path(runs_dir, cell.name, cell.key).unlink(missing_ok=True)
                if bar is None:  # a log (no bar): one line per finished run
                    print(f"finished {cell.name}: {cell.path(runs_dir)}", file=sys.stderr, flush=True)
            claims.release(cell)
            if bar is not None:
                bar.update(1)
    finally:
        claims.release_all()
        if bar is not None:
            bar.close()
    if busy:
        print(
            f"{len(busy)} run(s) were in flight in another process on {runs_dir} "
            f"({', '.join(c.name for c in busy[:3])}{', ...' if len(busy) > 3 else ''}): left to it",
            file=sys.stderr,
        )
    return records, failures


def record_differences(old: dict, new: dict) -> list[str]:
    """Where two records of one cell disagree in what the run measured: metrics and curves, compared
    exactly, over the keys both have (a record made before a metric existed lacks it; timings and
    provenance are not results). Each entry names the key and, for numbers, the largest relative gap (for a
    metric, first the recorded and the new value, None said 'never'); for a curve, also the first evaluation
    point that differs (round-off agrees to ~1e-7 there and may grow
    later in a chaotic run; a change in the code usually differs by more, or from the start)."""
    diffs = []
    if old.get("key") != new.get("key"):
        diffs.append(f"config hash {old.get('key')} != {new.get('key')}")
    curves_a, curves_b = old.get("curves", {}), new.get("curves", {})
    axis = next((k for k in ("epoch", "step") if curves_a.get(k) == curves_b.get(k) and k in curves_a), None)
    for part in ("metrics", "curves"):
        a, b = old.get(part, {}), new.get(part, {})
        for k in sorted(set(a) & set(b)):
            if a[k] != b[k]:
                details = [f"{_said(a[k])} → {_said(b[k])}"] if part == "metrics" and _scalar(a[k], b[k]) else []
                gap = _largest_relative_gap(a[k], b[k])
                if gap is not None:
                    details.append(f"relative {gap:.1e}")
                    first = _first_difference(a[k], b[k]) if part == "curves" else None
                    if first is not None:
                        where = f"{axis} {curves_a[axis][first]}" if axis and k != axis else f"point {first}"
                        details.append(
                            f"first differs at {where} by {_largest_relative_gap(a[k][first], b[k][first]):.1e}"
                        )
                diffs.append(f"{part}.{k}" + (f" ({'; '.join(details)})" if details else ""))
    return diffs


def _scalar(*values) -> bool:
    return all(v is None or isinstance(v, (int, float)) for v in values)


def _said(x) -> str:
    """A metric's value for the rerun line: 'never' for a time never reached (None), numbers to 6 digits."""
    return "never" if x is None else f"{x:.6g}"


def _first_difference(a, b) -> int | None:
    """Index of the first differing entry of two equally long lists (None for anything else)."""
    if not (isinstance(a, list) and isinstance(b, list) and len(a) == len(b)):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _largest_relative_gap(a, b) -> float | None:
    """max |a - b| / max(|a|, |b|) over matching numbers of two equally shaped values; None if not comparable."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(a - b) / max(abs(a), abs(b), 1e-300)
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        gaps = [_largest_relative_gap(x, y) for x, y in zip(a, b)]
        return None if any(g is None for g in gaps) else max(gaps, default=0.0)
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return _largest_relative_gap([a[k] for k in sorted(a)], [b[k] for k in sorted(a)])
    return None
