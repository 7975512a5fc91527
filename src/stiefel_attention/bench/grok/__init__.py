"""Modular-arithmetic grokking: epochs to 95% validation accuracy (the paper's second testbed).

protocol.py (constants the runs and the report share), task.py (the (a op b) mod p tables), run.py (config,
cells, one training run), interventions.py (the mechanism experiment's summary), report.py (records -> summary,
markdown, plots, claim rows)."""

from .run import FAMILY

__all__ = ["FAMILY"]
