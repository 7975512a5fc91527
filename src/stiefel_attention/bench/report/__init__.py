"""The report layer: records -> summary.json -> summary.md + plots -> REPORT.md, for every family.

stats.py (paired comparisons, bootstrap intervals), fmt.py (numbers and figures), geometry.py (comparisons,
standings and the sections of REPORT.md that set testbeds side by side), factorial.py (the geometry x optimizer
table), summaries.py (the typed records that one module writes and another reads), document.py (placing records
in experiments, rebuilding every summary, REPORT.md and the README's findings). Nothing here imports a family:
families are reached through the registry (bench.family) and their hooks.
"""

from .document import (
    FINDINGS_END,
    FINDINGS_START,
    Placement,
    check_current,
    check_placed,
    claim_rows,
    comparison_rows,
    findings_lines,
    load_records,
    place_records,
    profiles_in,
    rebuild_all,
    rebuild_family,
    verdict,
    verdict_kind,
    write_claims_report,
    write_experiment,
    write_findings,
)

__all__ = [
    "FINDINGS_END",
    "FINDINGS_START",
    "Placement",
    "check_current",
    "check_placed",
    "claim_rows",
    "comparison_rows",
    "findings_lines",
    "load_records",
    "place_records",
    "profiles_in",
    "rebuild_all",
    "rebuild_family",
    "verdict",
    "verdict_kind",
    "write_claims_report",
    "write_experiment",
    "write_findings",
]
