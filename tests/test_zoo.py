"""stiefelize across the transformers model zoo: the committed table (docs/zoo.md, made by tools/zoo.py) covers
every model type of the installed transformers and says what the current code does with each, and every layout
of a weight the adapters know is checked on a model that has it (heads, forward, step, unstiefelize, generate,
save/load). The full sweep (~2 minutes) is the `zoo` test; `pytest -k zoo_representative` runs the short one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "zoo.json"


@pytest.fixture(scope="module")
def zoo():
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import zoo as module
    finally:
        sys.path.remove(str(ROOT / "tools"))
    transformers.logging.set_verbosity_error()
    return module


# one model per layout of W_Q, W_K an adapter knows, and per way a model treats q and k before its logits
REPRESENTATIVE = {
    "llama": "separate q_proj, k_proj; grouped-query attention; rotary",
    "qwen3": "a norm per head on q and k",
    "olmo2": "a norm over all heads at once on q and k",
    "phi": "partial rotary",
    "opt": "q scaled inside the projection step",
    "gpt2": "fused Conv1D c_attn",
    "gpt_bigcode": "fused nn.Linear c_attn with multi-query attention",
    "gpt_neox": "fused query_key_value, q, k, v interleaved per head",
    "falcon": "fused query_key_value of multi-query attention",
    "persimmon": "interleaved per head, with a layer norm per head",
    "qwen3_next": "queries and an output gate per head in q_proj; linear-attention layers left alone",
    "hunyuan_v1_dense": "a norm per head on q and k after the rotary embedding",
    "mpt": "fused Wqkv",
    "bert": "query, key",
    "t5": "q, k, and cross-attention",
    "vit": "vision encoder",
    "deberta-v2": "query_proj, key_proj (disentangled attention)",
}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(REPRESENTATIVE))
def test_zoo_representative_layouts_convert_and_pass_every_check(zoo, model_type):
    row = zoo.check_type(model_type)
    assert row["status"] == "converted", row
    assert all(v is not False for v in row["checks"].values()), row
    assert row["checks"]["step"] and row["checks"]["unstiefelize"] and row["checks"]["forward"], row
    if model_type not in ("mpt", "deberta-v2"):  # those two do not go through transformers' attention functions
        assert row["checks"]["heads"] is True, row


@pytest.mark.slow
def test_zoo_falcon_grouped_per_key_value_head(zoo):
    """Falcon-40B's layout of the fused weight (the default config's multi-query one is in the sweep): each
    key-value group's query heads, its key, its value; every head checked against the model's own attention."""
    row = zoo.check_type("falcon", new_decoder_architecture=True, num_kv_heads=2)
    assert row["status"] == "converted" and all(v is not False for v in row["checks"].values()), row
    assert row["checks"]["heads"] is True, row


def test_zoo_refusals_say_why(zoo):
    from stiefel_attention import stiefelize
    from stiefel_attention.convert import StiefelizeError

    cases = (
        ("mamba", "no softmax attention"),
        ("deepseek_v2", "multi-head latent attention"),
        ("kimi_linear", "multi-head latent attention"),
    )  # its linear-attention layers have q_proj, k_proj
    for model_type, why in cases:
        config = zoo.small_config(model_type)
        with __import__("torch").device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        with pytest.raises(StiefelizeError, match=why):
            stiefelize(model)


def test_the_zoo_table_lists_every_installed_model_type(zoo):
    table = json.loads(TABLE.read_text())
    assert table["transformers"] == transformers.__version__, (
        f"docs/zoo.md was made with transformers {table['transformers']}, this is {transformers.__version__}: "
        "run python tools/zoo.py"
    )
    assert sorted(r["type"] for r in table["rows"]) == zoo.model_types()
    md = (ROOT / "docs" / "zoo.md").read_text()
    assert all(f"| {r['type']} | {r['status']} |" in md for r in table["rows"])


@pytest.mark.slow
@pytest.mark.zoo
def test_zoo_the_table_is_what_the_current_code_does(zoo):
    """Every type again (~2 minutes on 2 cores): status and each check as the committed table says."""
    table = {r["type"]: r for r in json.loads(TABLE.read_text())["rows"]}
    changed = []
    for model_type in zoo.model_types():
        row = zoo.check_type(model_type)
        if (row["status"], row["checks"]) != (table[model_type]["status"], table[model_type]["checks"]):
            changed.append(f"{model_type}: table {table[model_type]['status']} {table[model_type]['checks']}, "
                           f"now {row['status']} {row['checks']}")  # fmt: skip
    assert changed == [], "docs/zoo.md is out of date (python tools/zoo.py):\n" + "\n".join(changed)


def test_zoo_shrinks_hybrids_to_one_layer_of_each_kind_and_heads_to_the_width(zoo):
    class Config:  # the fields a hybrid's config has (first layers all linear attention, as Qwen3-Next's are)
        num_hidden_layers = 2
        layer_types = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]

    config = Config()
    zoo._shrink_layer_types(config)
    assert config.layer_types == ["linear_attention", "full_attention"] and config.num_hidden_layers == 2
    shrunk = zoo.small_config("cpmant")  # its head width is a field of its own (dim_head 128 > width 64)
    assert shrunk.dim_head == 16 and shrunk.hidden_size == 64
    shrunk = zoo.small_config("gemma4_text")  # built without its per-layer overrides (wider full-attention heads)
    assert shrunk.head_dim == 16 and not shrunk.to_dict().get("per_layer_config")
    assert "full_attention" in shrunk.layer_types


def test_the_readme_states_the_tables_counts():
    """README's sentence on the zoo gives the committed table's counts, so it cannot drift from docs/zoo.json."""
    import re

    rows = json.loads(TABLE.read_text())["rows"]
    count = {s: sum(r["status"] == s for r in rows) for s in {r["status"] for r in rows}}
    verified = sum(r["status"] == "converted" and r["checks"].get("heads") is True for r in rows)
    readme = " ".join((ROOT / "README.md").read_text().split())
    words = {"three": 3}
    found = re.search(
        r"(\d+) convert and pass every check, (\d+) of them verified head by head .*?; (\w+) convert but fail the "
        r"head check.*?; (\d+) are refused with the reason.*?; (\d+) have no tiny config",
        readme,
    )
    assert found, "README no longer states the zoo's counts in the expected sentence"
    fails = words.get(found[3], found[3])
    assert [int(found[1]), int(found[2]), int(fails), int(found[4]), int(found[5])] == [
        count.get("converted", 0),
        verified,
        count.get("converted, a check fails", 0),
        count.get("refused", 0),
        count.get("no small config", 0),
    ]
