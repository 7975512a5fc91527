"""The benchmark scripts write their measured tables into docs/performance.md; these check that plumbing
(not any timing: timings live in the benchmarks' own output, never in tests)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from readme import replace_block  # noqa: E402


def test_replace_block_swaps_only_the_text_between_the_markers(tmp_path):
    f = tmp_path / "README.md"
    f.write_text("head\n<!-- x:start -->\nold\n<!-- x:end -->\ntail\n")
    replace_block(str(f), "new line 1\nnew line 2", "<!-- x:start -->", "<!-- x:end -->")
    assert f.read_text() == "head\n<!-- x:start -->\nnew line 1\nnew line 2\n<!-- x:end -->\ntail\n"
    with pytest.raises(SystemExit, match="no <!-- y:start -->"):
        replace_block(str(f), "text", "<!-- y:start -->", "<!-- y:end -->")


@pytest.mark.parametrize("markers", ["benchmark", "distributed", "grok-speed"])
def test_the_performance_page_holds_each_benchmark_block(markers):
    text = (ROOT / "docs" / "performance.md").read_text()
    assert text.count(f"<!-- {markers}:start -->") == 1 and text.count(f"<!-- {markers}:end -->") == 1


def test_grok_speed_table_projects_20k_epochs_from_the_measured_rate():
    import grok_speed

    result = {
        profile: {
            "model": dict(p=97, d_model=64, n_heads=4, head_dim=16, d_mlp=256),
            "steps_per_s": {"adamw": 40.0, "stiefel-adam": 20.0},
        }
        for profile in ("cpu", "paper")
    }
    table = grok_speed.markdown_table(result)
    assert "| cpu | p=97, d_model 64, 4 heads of 16, MLP 256 | adamw | 40.0 | 8.3 min |" in table  # 20000 / 40 / 60
    assert "| paper | p=97, d_model 64, 4 heads of 16, MLP 256 | stiefel-adam | 20.0 | 16.7 min |" in table
