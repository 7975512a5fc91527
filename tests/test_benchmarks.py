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


@pytest.mark.parametrize("markers", ["benchmark", "distributed", "grok-speed", "front-door"])
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


def test_front_door_table_and_readme_line_say_each_time_its_load_and_any_failure():
    import front_door

    result = {"cpus": 2, "machine": "x86_64", "torch": "2.13.0", "code_version": "abc1234"}
    row = dict(
        name="reproduce", command="stiefel-attention reproduce --profile smoke --out {tmp}/r", what="w", returncode=0
    )
    result["rows"] = [
        dict(row, seconds=754.0, load_before=2.0, load_after=3.5),
        dict(
            row,
            name="demo",
            command="stiefel-attention demo",
            seconds=21.6,
            returncode=1,
            load_before=0.4,
            load_after=0.6,
        ),
    ]
    table = front_door.markdown_table(result)
    # a row without its own code version (files written before rows carried one) names the file's
    assert "| `stiefel-attention reproduce --profile smoke --out DIR/r` | w | 12.6 min | 2.0 → 3.5 | abc1234 |" in table
    assert "| `stiefel-attention demo` | w | 22 s (failed, exit 1) | 0.4 → 0.6 | abc1234 |" in table
    # rows come in the page's order (demo first), whatever order the file holds them in
    assert table.index("stiefel-attention demo`") < table.index("stiefel-attention reproduce")
    # every command the page promises has a row: one not measured says so, and how to measure it
    assert "| `python examples/hf_gpt2_char.py` | a transformers GPT-2, converted | not measured yet" in table
    assert "`stiefel-attention certify` | the propositions" in table
    assert front_door.readme_line(result).startswith("12.6 min measured on 2 cores at a load average of 2.0 to 3.5")
    assert "not measured yet" in front_door.readme_line(dict(result, rows=result["rows"][1:]))


def test_front_door_json_keeps_the_rows_not_measured_now_with_their_own_code_version():
    import front_door

    def row(name, seconds, **extra):
        return dict(
            name=name, command=name, what="w", returncode=0, seconds=seconds, load_before=0.1, load_after=0.2, **extra
        )

    earlier = {
        "cpus": 2,
        "machine": "x86_64",
        "torch": "t",
        "code_version": "old0000",
        "rows": [row("demo", 9.0), row("reproduce", 220.0)],
    }
    now = {
        "cpus": 2,
        "machine": "x86_64",
        "torch": "t",
        "rows": [row("hf_trainer", 300.0, code_version="new1111"), row("demo", 8.0, code_version="new1111")],
    }
    result = front_door.merged(earlier, now)
    assert [(r["name"], r["seconds"], r["code_version"]) for r in result["rows"]] == [
        ("demo", 8.0, "new1111"),  # measured again: the new row replaces the old
        ("hf_trainer", 300.0, "new1111"),  # in the page's order
        ("reproduce", 220.0, "old0000"),  # kept, naming the code it was measured with
    ]
    assert front_door.merged(None, now) is now
    table = front_door.markdown_table(result)
    assert "| w | 3.7 min | 0.1 → 0.2 | old0000 |" in table and "| w | 5.0 min | 0.1 → 0.2 | new1111 |" in table


def test_the_readme_holds_the_smoke_time_block_the_front_door_benchmark_writes():
    text = (ROOT / "README.md").read_text()
    assert text.count("<!-- smoke-time:start -->") == 1 and text.count("<!-- smoke-time:end -->") == 1


def test_each_rules_floor_issues_exactly_the_products_its_step_issues():
    import torch

    from optimizer_step import _product_floors, count_products
    from stiefel_attention import LandingStiefelAdam, StiefelAdam, StiefelMuon, random_frame
    from stiefel_attention.bench.kong import KongStiefelAdam

    gen = torch.Generator().manual_seed(0)
    frames = [random_frame(3, d=40, r=4, generator=gen) for _ in range(2)]
    grads = [torch.randn(f.shape, generator=gen) * 1e-2 for f in frames]

    def stepper(make):
        params = [f.clone().requires_grad_() for f in frames]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        return make(params).step

    steps = {
        "StiefelAdam(max_step=0.1)": stepper(lambda p: StiefelAdam(p, lr=1e-2, max_step=0.1)),
        "StiefelMuon": stepper(lambda p: StiefelMuon(p, lr=1e-2)),
        "LandingStiefelAdam": stepper(lambda p: LandingStiefelAdam(p, lr=1e-2, max_step=0.1)),
        "Kong et al. Stiefel Adam": stepper(lambda p: KongStiefelAdam(p, lr=1e-3)),
    }
    counts = {name: count_products(step, 40) for name, step in steps.items()}
    # the update rule's five d-sized products per frame tensor (optim.py's docstring), and the others' counts
    assert counts["StiefelAdam(max_step=0.1)"] == (3 * 2, 2 * 2)
    assert counts["LandingStiefelAdam"] == counts["Kong et al. Stiefel Adam"] == (5 * 2, 7 * 2)
    assert counts["StiefelMuon"][0] > 4 * 2  # its inner solve's iterations add products
    floors = _product_floors(frames, grads, counts)
    assert {name: count_products(fn, 40) for name, fn in floors.items()} == {
        f"floor of {n}": c for n, c in counts.items()
    }
