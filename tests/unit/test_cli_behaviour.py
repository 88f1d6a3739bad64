"""The CLI's parsing contract: overrides after flags, --version, help with defaults and an example, the
verb's own usage on errors; plus the study's seed list, demo presets from any folder, {output_dir} paths."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pipeline import config
from pipeline.cli import _all_parsers, build_parser, main, parse_args
from pipeline.config import ConfigError
from pipeline.study import parse_seeds, study_runs

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv):
    return parse_args(build_parser(), list(argv))


def test_dotted_overrides_are_accepted_after_flags():
    args = parse("prepare", "configs/tiny_prism.yaml", "--overwrite", "data.tasks=2", "data.workers=1")
    assert args.config == "configs/tiny_prism.yaml" and args.overwrite
    assert args.overrides == ["data.tasks=2", "data.workers=1"]
    args = parse("study", "a.yaml", "b.yaml", "--seeds", "2", "run.output_dir=x")
    assert args.items == ["a.yaml", "b.yaml", "run.output_dir=x"] and args.seeds == "2"
    args = parse("eval", "ckpt", "--limit", "5", "data.tokenizer=t.json")
    assert args.overrides == ["data.tokenizer=t.json"] and args.limit == 5


def test_a_stray_argument_fails_with_the_verbs_usage(capsys):
    with pytest.raises(SystemExit) as e:
        parse("prepare", "configs/tiny_prism.yaml", "--overwrite", "--bogus")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: prism prepare") and "unrecognized arguments: --bogus" in err
    with pytest.raises(SystemExit):
        parse("compare", "--experiment", "x", "train.lr=1")  # compare takes no overrides
    assert "usage: prism compare" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("prism ")


def test_every_verb_help_states_defaults_and_ends_with_an_example():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in _all_parsers(sub):
        if any(isinstance(a, argparse._SubParsersAction) for a in p._actions):
            continue  # a group (schedule, model, tracking): its actions carry the examples
        text = p.format_help()
        assert text.rstrip().split("\n\n")[-1].startswith("example: prism "), name  # the last paragraph
        for action in p._actions:
            if action.option_strings and action.default is not argparse.SUPPRESS:
                assert action.help, f"prism {name} {action.option_strings[0]} has no help"
                assert "default" in p._get_formatter()._get_help_string(action), (name, action.option_strings)


def test_study_seeds_and_runs():
    assert parse_seeds("3") == [1, 2, 3] and parse_seeds("5,7") == [5, 7] and parse_seeds("2-4") == [2, 3, 4]
    for bad in ("x", "0", "1,1"):
        with pytest.raises(ConfigError):
            parse_seeds(bad)
    runs = study_runs([str(ROOT / "configs/tiny_uniform.yaml"), str(ROOT / "configs/tiny_prism.yaml")], [1, 2], [])
    assert [(r.cfg.run.seed, r.name) for r in runs] == [
        (1, "uniform-tiny-s1"),
        (1, "prism-tiny-s1"),
        (2, "uniform-tiny-s2"),
        (2, "prism-tiny-s2"),
    ]
    with pytest.raises(ConfigError, match="different experiments"):
        study_runs([str(ROOT / "configs/tiny_prism.yaml"), str(ROOT / "configs/prism_124m.yaml")], [1], [])


def test_data_paths_follow_run_output_dir():
    cfg = config.load(ROOT / "configs/tiny_prism.yaml", ["run.output_dir=/tmp/elsewhere"])
    assert cfg.data.dataset_dir == "/tmp/elsewhere/data/embedded-bpe8k-256"
    assert cfg.data.tokenizer.startswith("/tmp/elsewhere/data/") and cfg.data.input.startswith("/tmp/elsewhere/")
    assert config.load(ROOT / "configs/tiny_prism.yaml").data.dataset_dir == "runs/data/embedded-bpe8k-256"


def test_a_moved_run_keeps_its_data_where_the_data_is(tmp_path, monkeypatch):
    """config.relocate: the one answer for search trials, schedule folders and jobs started elsewhere."""
    monkeypatch.chdir(tmp_path)
    preset = ROOT / "configs/tiny_prism.yaml"
    cfg = config.load(preset)  # run.output_dir=runs, relative to this directory
    here = tmp_path / "runs" / "data"
    here.mkdir(parents=True)
    (here / "embedded-bpe8k-256").symlink_to(tmp_path)  # a linked data folder keeps the name it was given
    moved = config.load(preset, config.relocate(cfg, "trials/t000"))
    assert moved.run.output_dir == str(tmp_path / "trials" / "t000")
    assert (moved.data.dataset_dir, moved.data.tokenizer, moved.data.input) == (
        str(here / "embedded-bpe8k-256"),
        str(here / "embedded-bpe8k.json"),
        str(here / "embedded-corpus"),
    )
    heldout = moved.data.val_sets["heldout"]
    assert (heldout.dataset_dir, heldout.input) == (
        str(here / "embedded-heldout-bpe8k-256"),
        str(here / "embedded-heldout-corpus"),
    )
    # a Hub tokenizer and a URL input are the same from anywhere: left as written
    hub = config.load(preset, ["data.tokenizer=gpt2", "data.input=hf://datasets/x/y", "data.input_format=parquet"])
    pinned = dict(o.split("=", 1) for o in config.relocate(hub, tmp_path))
    assert (pinned["data.tokenizer"], pinned["data.input"]) == ("gpt2", "hf://datasets/x/y")


def test_demo_finds_its_presets_from_any_directory(tmp_path, monkeypatch):
    from pipeline.demo import find_presets

    monkeypatch.chdir(tmp_path)
    assert find_presets() == ROOT / "configs"
    assert main(["demo", "--preset-dir", str(tmp_path), "run.output_dir=" + str(tmp_path)]) == 2


def test_eval_out_naming_a_folder_is_one_line_before_anything_loads(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "no-such-checkpoint"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0] and "is a folder" in err[0] and "eval.json" in err[0], err


def test_one_preset_lookup_for_every_verb(tmp_path, monkeypatch):
    from pipeline import search
    from pipeline.runs import plan

    monkeypatch.chdir(tmp_path)  # not the checkout: names still find the project's presets
    want = (ROOT / "configs" / "prism_124m.yaml").resolve()
    assert {config.find_preset(t) for t in ("prism_124m", "prism_124m.yaml", "configs/prism_124m.yaml")} == {want}
    assert plan.preset_path("prism", "124m") == want
    assert config.find_preset("no_such_preset") is None
    # a file next to the spec wins over the project's preset of that name
    (tmp_path / "prism_124m.yaml").write_text(f"base: {want}\ntrain: {{lr: 1.0e-3}}\n")
    assert config.find_preset("prism_124m.yaml", tmp_path) == (tmp_path / "prism_124m.yaml").resolve()
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "config: tiny_prism\nspace: {schedules: ['3x2,6x2,12x4']}\nrungs: {min_tokens: 2048, reduction_factor: 2, full_tokens: 8192}\n"
    )
    assert search.load_spec(spec).config_path == (ROOT / "configs" / "tiny_prism.yaml").resolve()
