"""How long the commands a new user runs first take on this machine: the README's main command, the demo,
certify and each example as its docstring runs it.

    python benchmarks/front_door.py [--json benchmarks/results/front_door.json] [--readme README.md]
        [--page docs/performance.md] [--only demo,certify]

Each command runs as a subprocess from the repository root, as a user types it, writing into a fresh temporary
folder (so nothing is reused from an earlier run), timed by the wall clock. The machine's load average is read
before and after each command and recorded beside its time: these are the times a user sees on a machine that
may be busy, not a benchmark of the code.
With --json, the commands measured now replace their rows in the file and the others keep theirs (each row
names the code version that was measured), so the slow examples can be timed on their own. With --readme, the
main command's line replaces the block between the smoke-time markers; with --page, the whole table replaces the
block between the front-door markers. Exit status: non-zero if any command failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from readme import replace_block  # benchmarks/readme.py, beside this script

ROOT = Path(__file__).resolve().parents[1]

# (name, argv, what it is): the commands as the README and each example's docstring give them. {root} is the
# repository; {tmp} the command's own fresh folder.
COMMANDS: tuple[tuple[str, list[str], str], ...] = (
    ("demo", ["stiefel-attention", "demo"], "a short training run that needs no data"),
    ("certify", ["stiefel-attention", "certify"], "the propositions, float64, with must-fail controls"),
    ("encoder_classifier", [sys.executable, "{root}/examples/encoder_classifier.py"], "nn.TransformerEncoder"),
    ("hf_gpt2_char", [sys.executable, "{root}/examples/hf_gpt2_char.py"], "a transformers GPT-2, converted"),
    (
        "hf_trainer",
        [sys.executable, "{root}/examples/hf_trainer.py", "--out", "{tmp}/hf_trainer", "--steps", "200"],
        "the Hugging Face Trainer, 200 steps",
    ),
    (
        "fsdp_lm",
        ["torchrun", "--nproc-per-node", "2", "{root}/examples/fsdp_lm.py", "--steps", "200", "--ckpt-dir", "{tmp}/c"],
        "FSDP2 over 2 processes (gloo), 200 steps",
    ),
    (
        "reproduce",
        ["stiefel-attention", "reproduce", "--profile", "smoke", "--out", "{tmp}/results-smoke"],
        "the README's main command: the whole paper at the smoke size",
    ),
)


def _shown(argv: list[str]) -> str:
    """The command as a user types it from the repository root."""
    return " ".join(argv).replace("{root}/", "").replace(str(ROOT) + "/", "").replace(sys.executable, "python")


def _loadavg() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def time_command(name: str, argv: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        args = [a.format(root=ROOT, tmp=tmp) for a in argv]
        load_before = _loadavg()
        start = time.perf_counter()
        done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)  # data found as a user's would be
        seconds = time.perf_counter() - start
    tail = (done.stdout + done.stderr)[-2000:]
    return {
        "name": name,
        "command": _shown(argv),
        "seconds": round(seconds, 1),
        "returncode": done.returncode,
        "load_before": round(load_before, 2),
        "load_after": round(_loadavg(), 2),
        "output_tail": tail if done.returncode else "",
    }


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def markdown_table(result: dict) -> str:
    lines = [
        f"Wall-clock time of each command a new user runs first (`benchmarks/front_door.py`, "
        f"{result['cpus']} cores, {result['machine']}, torch {result['torch']}); the load average (1 min) before "
        "and after each shows how busy the machine was (2 or more: other work shared the cores). DIR is a fresh "
        "folder of each command's own:",
        "",
        "| command | what | time | load before → after | code |",
        "|---|---|---|---|---|",
    ]
    rows = {row["name"]: row for row in result["rows"]}
    for name, argv, what in COMMANDS:  # every command the page promises, measured or not, in the page's order
        row = rows.get(name)
        if row is None:
            command = _shown(argv).replace("{tmp}", "DIR")
            lines.append(f"| `{command}` | {what} | not measured yet (`front_door.py --only {name}`) | — | — |")
            continue
        status = "" if row["returncode"] == 0 else f" (failed, exit {row['returncode']})"
        lines.append(
            f"| `{row['command'].replace('{tmp}', 'DIR')}` | {row['what']} | {_duration(row['seconds'])}{status} | "
            f"{row['load_before']:.1f} → {row['load_after']:.1f} | {_row_code(row, result)} |"
        )
    return "\n".join(lines)


def _row_code(row: dict, result: dict) -> str:
    """The code version a row was measured with (files written before rows carried one name it once)."""
    return row.get("code_version", result.get("code_version", "?"))


def merged(earlier: dict | None, now: dict) -> dict:
    """`now`'s rows, and `earlier`'s rows for the commands not measured now (each keeps its code version)."""
    if earlier is None:
        return now
    measured = {row["name"] for row in now["rows"]}
    kept = [dict(row, code_version=_row_code(row, earlier)) for row in earlier["rows"] if row["name"] not in measured]
    order = [c[0] for c in COMMANDS]
    rows = sorted(kept + now["rows"], key=lambda row: order.index(row["name"]) if row["name"] in order else len(order))
    return dict(now, rows=rows)


def readme_line(result: dict) -> str:
    """The README's sentence on the main command's time, from the measurement."""
    row = next((r for r in result["rows"] if r["name"] == "reproduce"), None)
    if row is None:
        return "not measured yet (`python benchmarks/front_door.py --readme README.md`)"
    return (
        f"{_duration(row['seconds'])} measured on {result['cpus']} cores at a load average of "
        f"{row['load_before']:.1f} to {row['load_after']:.1f} ([every first command timed](docs/performance.md))"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="write the measurement here")
    parser.add_argument("--readme", default=None, help="replace README's smoke-time block")
    parser.add_argument("--page", default=None, help="replace the page's front-door block")
    parser.add_argument("--only", default=None, help="comma-separated command names (default: every command)")
    parser.add_argument("--from-json", default=None, help="write the blocks from this measurement; run nothing")
    args = parser.parse_args(argv)
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        _write(result, args)
        return 1 if any(r["returncode"] for r in result["rows"]) else 0
    names = [c[0] for c in COMMANDS]
    chosen = names if args.only is None else args.only.split(",")
    unknown = set(chosen) - set(names)
    if unknown:
        parser.error(f"unknown commands {sorted(unknown)}; choose from {', '.join(names)}")
    from stiefel_attention.bench.records import code_version

    version = code_version()[:7]  # read first: a commit made while the commands run is not the code they ran
    rows = []
    for name, command, what in COMMANDS:
        if name not in chosen:
            continue
        row = time_command(name, command)
        row["what"] = what
        print(
            f"{name}: {row['seconds']:.1f} s, exit {row['returncode']}, load {row['load_before']} -> "
            f"{row['load_after']}",
            flush=True,
        )
        if row["returncode"]:
            print(row["output_tail"], file=sys.stderr)
        rows.append(row)
    import torch

    result = {
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "rows": [dict(row, code_version=version) for row in rows],
    }
    if args.json:
        path = Path(args.json)
        result = merged(json.loads(path.read_text()) if path.exists() else None, result)
        path.write_text(json.dumps(result, indent=2) + "\n")
    _write(result, args)
    return 1 if any(r["returncode"] for r in rows) else 0  # the commands measured now


def _write(result: dict, args: argparse.Namespace) -> None:
    """Print the table; put it and the README's line between their markers where asked."""
    print(markdown_table(result))
    if args.page:
        replace_block(args.page, markdown_table(result), "<!-- front-door:start -->", "<!-- front-door:end -->")
    if args.readme:
        replace_block(args.readme, readme_line(result), "<!-- smoke-time:start -->", "<!-- smoke-time:end -->")


if __name__ == "__main__":
    raise SystemExit(main())
