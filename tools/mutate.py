"""The mutation check: does the test suite catch small slips in the code? (issue 44)

    python tools/mutate.py [--only ID,...] [--report PATH] [--jobs N] [--timeout S] [--stale]

The repository's files (`git ls-files`: tracked, and untracked ones git does not ignore, as they are in the
working tree) are copied once, when the run starts; then, for each mutant of tools/mutants.py, that snapshot is
copied into a scratch folder, the mutant's edit applied there, and `python -m pytest -x -q -p no:cacheprovider <its
tests>` run in that folder with PYTHONPATH=<scratch>/src, so that the mutated copy is imported rather than the
editable install (checked before the first run). The working tree is only read. A mutant is

- killed: its tests fail (or run past the deadline: three times their unmutated time, at least 2 minutes);
- survived: its tests pass;
- stale: one of its old strings does not occur exactly once in the file any more (the code moved on: update it);
- error: its tests fail or time out unmutated (checked once per distinct test set, before any mutant runs).

The markdown report (default tools/mutation-report.md) lists every mutant with its seconds and first failing test.
The command exits 1 if fewer than 95% of the mutants that can be killed are (equivalent ones, marked in the
registry, are left out of the rate), or if any mutant is stale, in error, or survives without a reason in the
registry; `--stale` only checks the edits against the working tree and runs nothing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
try:
    from mutants import MUTANTS, Mutant
finally:
    sys.path.remove(str(ROOT / "tools"))

KILL_RATE = 0.95
MIN_DEADLINE_S = 120.0


@dataclass
class Result:
    mutant: Mutant
    status: str  # killed, survived, stale, error
    seconds: float = 0.0
    detail: str = ""  # the first failing test, or why stale / error
    pytest_line: str = ""  # pytest's last line ("1 failed, 3 passed in 9.1s")


@dataclass
class Baseline:
    ok: bool
    seconds: float
    detail: str = ""
    pytest_line: str = ""


def repo_files(root: Path) -> list[str]:
    """The files a commit of the working tree would hold: tracked ones that still exist, and untracked ones git
    does not ignore (new files not yet added)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return sorted({f for f in out.split("\0") if f and (root / f).is_file()})


def copy_files(root: Path, files: list[str], dest: Path) -> None:
    for f in files:
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, target)


def mutated_text(text: str, mutant: Mutant) -> tuple[str | None, str]:
    """(the text with every edit applied, "") or (None, why the mutant is stale)."""
    for i, (old, new) in enumerate(mutant.edits, 1):
        n = text.count(old)
        if n != 1:
            where = f"edit {i} of {len(mutant.edits)}" if len(mutant.edits) > 1 else "its old string"
            return None, f"{where} occurs {n} times in {mutant.file}, not once"
        text = text.replace(old, new, 1)
    return text, ""


def stale_reason(root: Path, mutant: Mutant) -> str:
    """Why the mutant cannot be applied to the working tree ("" when it can)."""
    path = root / mutant.file
    if not path.is_file():
        return f"{mutant.file} does not exist"
    missing = [t for t in mutant.tests if not (root / t).is_file()]
    if missing:
        return f"its tests {', '.join(missing)} do not exist"
    return mutated_text(path.read_text(), mutant)[1]


def _last_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ", 1)[0]
    return _last_line(output)


def _pytest(scratch: Path, mutant: Mutant, deadline_s: float) -> tuple[int | None, float, str]:
    """Run the mutant's tests in scratch: (exit code, or None past the deadline; seconds; output)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutant.tests]
    if mutant.k:
        cmd += ["-k", mutant.k]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(scratch / "src"), env.get("PYTHONPATH")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    t0 = time.monotonic()
    # a session of its own, so that a deadline ends the processes its tests started too
    proc = subprocess.Popen(
        cmd, cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=deadline_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = None
    return code, time.monotonic() - t0, out.decode(errors="replace")


class Runner:
    """Runs mutants of one repository, each in a scratch copy of `files` (default: repo_files(root))."""

    def __init__(
        self, root: Path = ROOT, files: list[str] | None = None, timeout_s: float = 1800.0, verbose: bool = False
    ):
        self.root = Path(root)
        self.source = self.root  # what scratch copies are made from: the working tree, or a snapshot of it
        self.verbose = verbose
        self.files = files if files is not None else repo_files(self.root)
        self.timeout_s = timeout_s
        self.baselines: dict[tuple, Baseline] = {}

    def _scratch(self, mutant: Mutant | None) -> Path:
        scratch = Path(tempfile.mkdtemp(prefix=f"mutant-{mutant.id if mutant else 'baseline'}-"))
        copy_files(self.source, self.files, scratch)
        if mutant is not None:
            path = scratch / mutant.file
            text, why = mutated_text(path.read_text(), mutant)
            if text is None:
                raise ValueError(why)
            path.write_text(text)
        return scratch

    def check_import(self) -> str:
        """Where a scratch copy's tests import stiefel_attention from: must be the copy, not the editable install."""
        scratch = self._scratch(None)
        try:
            env = {**os.environ, "PYTHONPATH": str(scratch / "src")}
            code = "import stiefel_attention; print(stiefel_attention.__file__)"
            out = subprocess.run([sys.executable, "-c", code], cwd=scratch, env=env, capture_output=True, text=True)
            where = out.stdout.strip()
            if not Path(where).resolve().is_relative_to(scratch.resolve()):
                raise RuntimeError(f"a scratch copy imports stiefel_attention from {where or out.stderr}, not itself")
            return where
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def baseline(self, mutant: Mutant) -> Baseline:
        key = (mutant.tests, mutant.k)
        if key not in self.baselines:
            scratch = self._scratch(None)
            try:
                code, seconds, out = _pytest(scratch, mutant, self.timeout_s)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            if code == 0:
                detail = ""
            elif code is None:
                detail = f"unmutated tests ran past {self.timeout_s:.0f} s"
            else:
                detail = f"unmutated tests fail: {_first_failure(out)}"
            self.baselines[key] = Baseline(code == 0, seconds, detail, _last_line(out))
            if self.verbose:
                tests = " ".join(mutant.tests) + (f" -k {mutant.k!r}" if mutant.k else "")
                print(f"unmutated {tests}: {_last_line(out)}", flush=True)
        return self.baselines[key]

    def run(self, mutant: Mutant) -> Result:
        why = stale_reason(self.source, mutant)
        if why:
            return Result(mutant, "stale", 0.0, why)
        base = self.baseline(mutant)
        if not base.ok:
            return Result(mutant, "error", base.seconds, base.detail)
        deadline = min(self.timeout_s, max(MIN_DEADLINE_S, 3.0 * base.seconds))
        scratch = self._scratch(mutant)
        try:
            code, seconds, out = _pytest(scratch, mutant, deadline)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        last = _last_line(out)
        if code is None:
            return Result(mutant, "killed", seconds, f"past the deadline ({deadline:.0f} s)", last)
        if code == 0:
            return Result(mutant, "survived", seconds, "", last)
        if code in (1, 2, 3):  # tests failed, collection interrupted (an import broke), internal error
            return Result(mutant, "killed", seconds, _first_failure(out), last)
        return Result(mutant, "error", seconds, f"pytest exit code {code}: {_first_failure(out)}", last)

    def run_all(self, mutants: list[Mutant], jobs: int = 1, on_result=None) -> list[Result]:
        """Every mutant's result, in order; on_result(result) is called as each one arrives. The files are copied
        once first, and every run starts from that snapshot: a run of hours sees one state of the code, whatever
        is edited meanwhile."""
        snapshot = Path(tempfile.mkdtemp(prefix="mutants-snapshot-"))
        try:
            copy_files(self.root, self.files, snapshot)
            self.source = snapshot
            live = [m for m in mutants if not stale_reason(self.source, m)]
            if live:
                self.check_import()
            results = []
            with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:  # every distinct test set once, unmutated
                distinct = {(m.tests, m.k): m for m in live}
                list(pool.map(self.baseline, distinct.values()))
                for result in pool.map(self.run, mutants):
                    results.append(result)
                    if on_result is not None:
                        on_result(result)
            return results
        finally:
            self.source = self.root
            shutil.rmtree(snapshot, ignore_errors=True)


def kill_rate(results: list[Result]) -> float:
    """Killed over the mutants that can be killed (killed, and survivors not marked equivalent)."""
    killed = sum(r.status == "killed" for r in results)
    can = killed + sum(r.status == "survived" and not r.mutant.equivalent for r in results)
    return killed / can if can else 1.0


def problems(results: list[Result]) -> list[str]:
    """Why the check fails (empty: it passes)."""
    out = []
    rate = kill_rate(results)
    if rate < KILL_RATE:
        out.append(f"kill rate {rate:.1%} < {KILL_RATE:.0%}")
    for status in ("stale", "error"):
        ids = [r.mutant.id for r in results if r.status == status]
        if ids:
            out.append(f"{status}: {', '.join(ids)}")
    unexplained = [r.mutant.id for r in results if r.status == "survived" and not r.mutant.reason]
    if unexplained:
        out.append(f"survived with no reason in tools/mutants.py: {', '.join(unexplained)}")
    return out


def summary(results: list[Result]) -> str:
    count = {s: sum(r.status == s for r in results) for s in ("killed", "survived", "stale", "error")}
    equivalent = sum(r.status == "survived" and r.mutant.equivalent for r in results)
    return (
        f"{len(results)} mutants: {count['killed']} killed, {count['survived']} survived ({equivalent} equivalent), "
        f"{count['stale']} stale, {count['error']} error; kill rate {kill_rate(results):.1%} "
        f"(killed / (killed + non-equivalent survivors); at least {KILL_RATE:.0%} required)"
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code_version(root: Path) -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown commit"
    return commit + (" with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def report(results: list[Result], version: str, wall_s: float | None = None) -> str:
    """The markdown report; version names the code the run copied (`_code_version`)."""
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [
        "# Mutation check",
        "",
        f"`python tools/mutate.py`, run {when} on {version}"
        + (f", in {wall_s / 60:.0f} minutes" if wall_s is not None else "")
        + ".",
        "The mutants and why the survivors survive: `tools/mutants.py`.",
        "",
        f"**{summary(results)}**",
        "",
    ]
    bad = problems(results)
    lines += [f"Check failed: {'; '.join(bad)}." if bad else "Check passed.", ""]
    lines += ["| id | file | mutation | tests | result | s | first failing test, or note |", "|---" * 7 + "|"]
    for r in results:
        m = r.mutant
        tests = " ".join(t.removeprefix("tests/") for t in m.tests) + (f" -k {m.k!r}" if m.k else "")
        note = r.detail
        if r.status == "survived":
            note = ("equivalent: " if m.equivalent else "") + (m.reason or "NO REASON GIVEN")
        elif r.status == "killed" and m.reason:
            note += " (the registry's reason for surviving is out of date)"
        file = m.file.removeprefix("src/stiefel_attention/")
        row = [m.id, file, m.description, tests, r.status, f"{r.seconds:.0f}", note]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    survivors = [r for r in results if r.status == "survived"]
    if survivors:
        lines += ["", "## Survivors", ""]
        for r in survivors:
            kind = "equivalent" if r.mutant.equivalent else "not equivalent"
            lines.append(f"- {r.mutant.id} ({kind}): {r.mutant.description}. {r.mutant.reason or 'NO REASON GIVEN'}")
    return "\n".join(lines) + "\n"


def select(only: str | None) -> list[Mutant]:
    ids = [m.id for m in MUTANTS]
    if len(set(ids)) != len(ids):
        raise SystemExit(f"duplicate mutant ids in tools/mutants.py: {sorted({i for i in ids if ids.count(i) > 1})}")
    if not only:
        return list(MUTANTS)
    wanted = [i.strip() for i in only.split(",") if i.strip()]
    unknown = [i for i in wanted if i not in ids]
    if unknown:
        raise SystemExit(f"unknown mutant ids: {', '.join(unknown)}")
    return [m for m in MUTANTS if m.id in wanted]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated mutant ids (default: all)")
    parser.add_argument("--report", default=str(ROOT / "tools" / "mutation-report.md"), help="markdown report path")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed to one test run")
    parser.add_argument("--stale", action="store_true", help="only check that every edit still applies")
    args = parser.parse_args(argv)
    mutants = select(args.only)
    if args.stale:
        stale = [(m.id, why) for m in mutants if (why := stale_reason(ROOT, m))]
        for mid, why in stale:
            print(f"{mid}: stale: {why}")
        print(f"{len(mutants) - len(stale)} of {len(mutants)} mutants apply")
        return 1 if stale else 0
    t0, version = time.monotonic(), _code_version(ROOT)

    def show(r: Result) -> None:
        print(f"{r.mutant.id:5} {r.status:8} {r.seconds:6.0f} s  {r.detail}  [{r.pytest_line}]", flush=True)

    results = Runner(ROOT, timeout_s=args.timeout, verbose=True).run_all(mutants, args.jobs, on_result=show)
    Path(args.report).write_text(report(results, version, time.monotonic() - t0))
    print(summary(results))
    bad = problems(results)
    if bad:
        print("mutation check failed: " + "; ".join(bad))
    print(f"report: {args.report}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
