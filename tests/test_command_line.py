"""The command line's front door: --version, `list`, seed ranges and lists, --set overrides (in the config, so in
the key), a run-count header that counts what will run, and output paths checked before any work."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from stiefel_attention.bench import cli
from stiefel_attention.bench.family import all_families, data_of, get_family, with_data

SMOKE_MQAR = ["mqar", "--experiment", "main", "--profile", "smoke", "--jobs", "1", "--no-progress"]


def _records(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((folder / "runs").glob("*.json"))]


def test_version_is_the_installed_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"stiefel-attention {version('stiefel-attention')}"


@pytest.mark.parametrize(
    ("text", "seeds"),
    [("3", 3), ("0-4", (0, 1, 2, 3, 4)), ("5,7", (5, 7)), ("0-2,7", (0, 1, 2, 7)), ("4", 4), ("2-2", (2,))],
)
def test_seeds_are_a_count_a_range_or_a_list(text, seeds):
    assert cli.parse_seeds(text) == seeds


@pytest.mark.parametrize(("text", "why"), [("0", ">= 1"), ("3-1", "backwards"), ("x", "not a count"), ("1,-2", "not")])
def test_a_bad_seed_selection_is_refused_saying_why(text, why):
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        cli.parse_seeds(text)


def test_listed_seeds_plan_the_very_runs_a_count_plans_for_those_seeds():
    from stiefel_attention.bench.experiment import RunRequest, seed_cells

    family = get_family("mqar")
    request = RunRequest(family, "main", "smoke", Path("unused"), {}, None, seeds=(1, 3))
    listed = seed_cells(request)
    counted = family.cells("main", "smoke", 4)
    assert {c.config["seed"] for c in listed} == {1, 3}
    assert [c.key for c in listed] == [c.key for c in counted if c.config["seed"] in (1, 3)]


def test_the_header_counts_what_will_run_and_what_is_already_recorded(tmp_path, capsys):
    out = tmp_path / "r"
    assert cli.main([*SMOKE_MQAR, "--seeds", "1", "--arms", "adamw", "--set", "steps=4", "--out", str(out)]) == 0
    capsys.readouterr()
    argv = [*SMOKE_MQAR, "--seeds", "0-1", "--arms", "adamw", "--set", "steps=4", "--out", str(out)]
    assert cli.main(argv) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("mqar main: 2 runs (profile smoke), 1 already recorded, 1 to run, arms adamw only")
    assert "seeds 0, 1" in header


def test_set_changes_the_config_and_so_the_key_and_the_record_says_so(tmp_path):
    out = tmp_path / "r"
    argv = [*SMOKE_MQAR, "--seeds", "1", "--arms", "adamw", "--out", str(out)]
    assert cli.main([*argv, "--set", "steps=4", "--set", "model.d_model=48", "--set", "lr=0.002"]) == 0
    (record,) = _records(out)
    assert record["config"]["steps"] == 4 and record["config"]["model"]["d_model"] == 48
    assert record["config"]["lr"] == 0.002 and record["config"]["settings"] == {
        "steps": 4,
        "model.d_model": 48,
        "lr": 0.002,
    }
    (plain,) = get_family("mqar").cells("main", "smoke", 1)[:1]
    assert record["key"] != plain.key and len(record["curves"]["step"]) <= 2  # 4 steps were trained, not 60
    # `report` takes these records as the experiment of the folder, rather than leaving them out
    assert cli.main(["report", str(out)]) == 0
    assert json.loads((out / "main" / "summary.json").read_text())


def test_a_set_of_an_unknown_key_or_another_type_is_refused_before_any_run(tmp_path, capsys):
    out = tmp_path / "r"
    assert cli.main([*SMOKE_MQAR, "--seeds", "1", "--set", "stepz=4", "--out", str(out)]) == cli.EXIT_USAGE
    assert "config has no stepz; its keys are arm, batch" in capsys.readouterr().err
    assert cli.main([*SMOKE_MQAR, "--seeds", "1", "--set", "steps=2.5", "--out", str(out)]) == cli.EXIT_USAGE
    assert "steps is 60 (int); give a value of that type" in capsys.readouterr().err
    assert not (out / "runs").exists() or not list((out / "runs").glob("*.json"))


def test_a_folder_holds_one_set_of_settings():
    records = [{"config": {"settings": {"steps": 4}}}, {"config": {"settings": {"steps": 5}}}]
    with pytest.raises(ValueError, match="keep one set of settings per results folder"):
        data_of(records)
    assert data_of(records[:1]) == {"settings": {"steps": 4}} and data_of([{"config": {}}]) == {}


def test_with_data_applies_settings_to_nested_keys_and_keeps_the_default_cells_untouched():
    cells = get_family("mqar").cells("main", "smoke", 1)
    changed = with_data(cells, {"settings": {"model.n_layers": 1}})
    assert all(c.config["model"]["n_layers"] == 1 for c in changed)
    assert all(c.config["model"]["n_layers"] == 2 and "settings" not in c.config for c in cells)
    assert with_data(cells, {}) is cells


def test_list_names_every_family_experiment_with_what_it_answers_and_the_planned_runs(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    for family in all_families():
        assert f"{family.name}: {family.help}" in out
        for experiment in family.experiments:
            assert family.experiment_help.get(experiment), f"{family.name} {experiment} has no line in `list`"
            assert f"--experiment {experiment}: {family.experiment_help[experiment]}" in out
    planned = len(get_family("mqar").cells("main", "smoke"))  # every main arm x 2 seeds
    assert (
        f"smoke: {planned} runs"
        in out.split("--experiment main: every arm at its tuned rates, 12 paired seeds: steps")[1]
    )


def test_list_estimates_the_time_left_from_the_recorded_run_times(tmp_path, monkeypatch):
    family = get_family("mqar")
    monkeypatch.chdir(tmp_path)
    cli._run_seconds.cache_clear()
    cells = family.cells("main", "smoke")
    runs = tmp_path / "results-smoke" / "mqar" / "runs"
    runs.mkdir(parents=True)
    for cell in cells[:2]:  # two of the plan recorded, at 1800 s each: every other run is estimated at 1800 s
        record = {"key": cell.key, "config": cell.config, "timings": {"total_s": 1800.0}}
        record.update(name=cell.name, family="mqar", code_version="x", metrics={}, curves={})
        cell.path(runs).write_text(json.dumps(record))
    try:
        line = cli._plan_line(family, "main", "smoke")
    finally:
        cli._run_seconds.cache_clear()
    assert line == f"smoke: {len(cells)} runs, 2 recorded, the rest about {(len(cells) - 2) * 0.5:.1f} core-hours"


def test_certify_refuses_a_json_path_it_cannot_write_before_it_certifies(tmp_path, monkeypatch, capsys):
    import stiefel_attention.certify as certify_module

    def never(**kwargs):
        raise AssertionError("certify ran before its --json path was checked")

    monkeypatch.setattr(certify_module, "certify", never)
    missing = tmp_path / "no-such-folder" / "c.json"
    assert cli.main(["certify", "--json", str(missing)]) == cli.EXIT_USAGE
    assert f"the folder {missing.parent} does not exist" in capsys.readouterr().err
    assert cli.main(["certify", "--json", str(tmp_path)]) == cli.EXIT_USAGE
    assert "is a folder" in capsys.readouterr().err


def test_demo_takes_a_seed_and_a_device_and_ends_with_what_the_two_arms_show(capsys):
    assert cli.main(["demo", "--steps", "2", "--seed", "3", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("adamw ") and lines[1].startswith("stiefel-adam ") and "on cpu)" in lines[1]
    assert lines[2].startswith("In short: stiefel-adam's W_Q, W_K stay orthonormal (isometry error ")
    assert cli.main(["demo", "--steps", "2", "--device", "no-such-device"]) == cli.EXIT_USAGE
    assert "--device 'no-such-device' cannot be used here" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("adamw", "stiefel", "words"),
    [((0.5, 2.0), (0.6, 1e-6), "is ahead of adamw's (0.600 vs 0.500"), ((0.5, 2.0), (0.49, 1e-6), "is level with"),
     ((0.5, 2.0), (0.3, 1e-6), "is behind adamw's"), ((0.5, 2.0), (0.5, 0.3), "left the manifold")],
)  # fmt: skip
def test_the_demo_conclusion_says_what_was_seen(adamw, stiefel, words):
    assert words in cli.demo_conclusion({"adamw": adamw, "stiefel-adam": stiefel}, 60)


@pytest.mark.parametrize("family", ["lm", "pretrained"])
def test_the_text_corpus_is_named_text_and_the_old_name_still_reads_it(family, capsys):
    parser = cli.build_parser()
    argv = [family, "--experiment", "main"]
    assert parser.parse_args([*argv, "--text", "a.txt"]).text == "a.txt"
    assert parser.parse_args([*argv, "--data", "b.txt"]).text == "b.txt"
    with pytest.raises(SystemExit):
        parser.parse_args([family, "--help"])
    shown = capsys.readouterr().out
    assert "--text TEXT" in shown and "--data" not in shown


def test_reproduce_hands_each_experiment_to_run_experiment_as_one_request(tmp_path, monkeypatch):
    """No argv round trip: reproduce builds a RunRequest per experiment, its options (--text) already read."""
    from stiefel_attention.bench import family as family_module

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Now is the winter of our discontent\nMade glorious summer by this sun of York;\n" * 40)
    seen: list = []
    monkeypatch.setattr(family_module, "FAMILY_MODULES", ("lm", "mqar"))
    monkeypatch.setattr(cli, "certify_into", lambda path, seed: 0)
    monkeypatch.setattr(cli, "report_folder", lambda *args: 0)
    monkeypatch.setattr(cli, "run_experiment", lambda request: seen.append(request) or 0)
    out = tmp_path / "r"
    argv = ["reproduce", "--profile", "smoke", "--out", str(out), "--jobs", "1", "--no-progress", "--text", str(corpus)]
    assert cli.main(argv) == 0
    lm, mqar = get_family("lm"), get_family("mqar")
    assert [(r.family.name, r.experiment) for r in seen] == [
        *(("lm", e) for e in lm.reproduce_order),
        *(("mqar", e) for e in mqar.reproduce_order),
    ]
    assert all(r.profile == "smoke" and r.progress is False and r.out == out / r.family.name for r in seen)
    assert {r.run_options["data"] for r in seen if r.family.name == "lm"} == {str(corpus)}


@pytest.mark.parametrize("command", ["cifar", "grok", "lm", "mqar", "pretrained", "reproduce"])
def test_every_command_defaults_to_the_smoke_profile_so_only_a_named_cpu_profile_writes_results(command):
    parser = cli.build_parser()
    argv = [command] if command == "reproduce" else [command, "--experiment", get_family(command).experiments[0]]
    args = parser.parse_args(argv)
    assert args.profile == "smoke" and cli.default_results_dir(args.profile) == Path("results-smoke")
    assert cli.default_results_dir("cpu") == Path("results")


def test_a_registered_family_is_listed_refused_in_worker_processes_and_removed_again(tmp_path, capsys):
    from stiefel_attention.bench.family import Family, register_family, unregister_family
    from stiefel_attention.bench.records import Cell

    class Tiny(Family):
        name, title, help = "tiny", "Tiny", "a family defined in a test"
        profiles = {"smoke": {}, "cpu": {}, "paper": {}}
        experiments = ("main",)
        experiment_help = {"main": "one cell"}

        def cells(self, experiment, profile, seeds=None, **options):
            return [Cell(self.name, "adamw-s0", dict(profile=profile, arm="adamw", seed=0))]

    register_family(Tiny())
    try:
        with pytest.raises(ValueError, match="a family named 'tiny' exists already"):
            register_family(Tiny())
        assert cli.main(["list", "tiny"]) == 0
        assert (
            "tiny: a family defined in a test\n  --experiment main: one cell\n      smoke: 1 runs"
            in capsys.readouterr().out
        )
        assert cli.main(["tiny", "--experiment", "main", "--out", str(tmp_path / "t"), "--jobs", "2"]) == 2
        assert "run it with --jobs 1" in capsys.readouterr().err and not (tmp_path / "t" / "runs").exists()
    finally:
        unregister_family("tiny")
    with pytest.raises(ValueError, match="unknown experiment family 'tiny'; registered: cifar, grok, lm, mqar"):
        get_family("tiny")
    with pytest.raises(ValueError, match="must set title"):
        register_family(type("Untitled", (Tiny,), {"title": ""})())
