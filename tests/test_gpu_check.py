"""benchmarks/gpu_check.py, the script a lent GPU runs, works before a GPU is lent: its checks pass on the CPU
(the CUDA graph reports itself skipped) and its JSON holds every check and measurement."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
def test_the_gpu_check_runs_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_check

    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--device", "cpu", "--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["checks"]) == {"parity", "drift", "cuda_graph", "compiled"}
    assert [c["passed"] for c in result["checks"].values()] == [True, True, None, True]
    assert result["checks"]["cuda_graph"]["skipped"] == "needs CUDA" and result["all_passed"]
    step = result["measurements"]["optimizer_step"]["x_adamw_foreach"]
    assert step["AdamW(foreach)"] == 1.0 and {"StiefelAdam(max_step=0.1)", "StiefelAdam(sync-free)"} <= set(step)
    assert set(result["measurements"]["cifar_paper"]["steps_per_s"]) == {"adamw", "stiefel-adam"}


def test_the_gpu_check_says_when_there_is_no_gpu(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_check

    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--device", "cuda"]) == 2
    assert "--device cpu" in capsys.readouterr().err
    assert "gpu_check" in sys.modules
