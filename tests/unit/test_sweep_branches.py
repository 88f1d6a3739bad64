"""A sweep over cooldown branches (issue #40): the ``configs:`` and ``cooldown:`` keys of a sweep spec make one
branch per (arm, seed, step), each a branch of its grid point's own main run, with `prism cooldown`'s decay;
a bad section is one line naming where it is; the shipped WSD-S spec lists its six branches."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import sweep
from pipeline.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY_ARMS = "configs: [configs/wsds/tiny_prism.yaml, configs/wsds/tiny_uniform.yaml]\n"


def grid(tmp_path: Path, text: str) -> list:
    spec = tmp_path / "spec.yaml"
    spec.write_text(text)
    return sweep.grid_of_spec(sweep.load_spec(spec))


def test_a_cooldown_section_gives_one_branch_per_arm_seed_and_step(tmp_path):
    runs = grid(
        tmp_path,
        f"{TINY_ARMS}seeds: [1, 2]\ncooldown: {{from_steps: [36, 72, 144], decay_fraction: 0.1}}\n"
        f"overrides: {{run.output_dir: {tmp_path}}}\n",
    )
    got = [(r.cfg.run.arm, r.cfg.run.seed, r.cfg.cooldown.from_step) for r in runs]
    assert got == [(arm, seed, step) for arm in ("prism", "uniform") for seed in (1, 2) for step in (36, 72, 144)]
    for r in runs:
        c, per_step = r.cfg.cooldown, r.cfg.train.batch_tokens
        assert r.cfg.is_branch and r.name == f"{r.cfg.run.arm}-tiny-s{r.cfg.run.seed}-cooldown-{c.from_step}"
        # the WSD-S rule: the decay is 10 % of the branch's length, 4/8/16 steps at 36/72/144
        assert c.decay_tokens == c.from_step // 9 * per_step
        main = tmp_path / f"{r.cfg.run.arm}-tiny-s{r.cfg.run.seed}"  # its grid point's, named as prism cooldown does
        assert r.cfg.main_run_dir == main and c.from_run_dir == str(main)
    assert len({r.run_dir for r in runs}) == 12
    assert "-> prism-tiny-s1-cooldown-144 (decays 16 steps)" in sweep.grid_table(runs)
    fixed = grid(tmp_path, f"{TINY_ARMS}seeds: [1]\ncooldown: {{from_steps: [36], decay_tokens: 4096}}\n")
    assert [r.cfg.cooldown.decay_tokens for r in fixed] == [4096, 4096]
    assert grid(tmp_path, f"{TINY_ARMS}seeds: [1]\n")[0].cfg.is_branch is False  # no section: the main runs


@pytest.mark.parametrize(
    ("section", "want"),
    [
        ("cooldown: {from_steps: [36], decay_fraction: 0.1, decay_tokens: 4096}", "give one of decay_tokens"),
        ("cooldown: {from_steps: [36]}", "give one of decay_tokens"),
        ("cooldown: {from_steps: [36, 36], decay_fraction: 0.1}", "cooldown.from_steps=[36, 36]: repeats a step"),
        ("cooldown: {from_steps: 36, decay_fraction: 0.1}", "cooldown.from_steps=36: must be a non-empty list"),
        ("cooldown: {from_steps: [36], decay_fraction: 1.5}", "cooldown.decay_fraction=1.5: must be in (0, 1)"),
        ("cooldown: {from_steps: [36], decay_tokens: 4096, decay_shape: exp}", "cooldown.decay_shape='exp'"),
        ("cooldown: {from_steps: [36], decay_tokens: 4096, steps: 2}", "unknown key cooldown.steps"),
        ("cooldown: {from_steps: [320], decay_tokens: 4096}", "ends at step 320, so a branch at step 320"),
        ("configs: [configs/wsds/nope.yaml]\nseeds: [1]", "'configs/wsds/nope.yaml' is not a file"),
        ("arms: [prism]\ncooldown: {from_steps: [36], decay_tokens: 4096}", "configs (preset paths) or arms"),
    ],
)
def test_a_bad_cooldown_or_configs_key_is_one_line_naming_it(tmp_path, section, want):
    text = section if section.startswith("configs") else f"{TINY_ARMS}seeds: [1]\n{section}\n"
    with pytest.raises(ConfigError) as err:
        grid(tmp_path, text)
    assert want in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert "spec.yaml" in str(err.value) or "sweep:" in str(err.value)


def test_the_shipped_wsds_124m_spec_lists_both_arms_branches(capsys):
    from pipeline.cli import main

    assert main(["sweep", str(ROOT / "launchers/sweeps/wsds_124m.yaml"), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    for arm in ("prism", "uniform"):
        for step, decay in ((4950, 550), (9900, 1100), (19800, 2200)):
            assert f"-> {arm}-124m-s1234-cooldown-{step} (decays {decay:,} steps)" in printed
    assert printed.rstrip().endswith("jobs: 6")


@pytest.mark.parametrize(
    "argv",
    [
        ["--from-step", "36", "72", "144", "--decay-fraction", "0.1", "train.device=cpu"],
        ["--decay-fraction", "0.1", "--from-step", "36", "72,144", "train.device=cpu"],
        ["--from-step", "36,72,144", "--decay-fraction", "0.1", "train.device=cpu"],
    ],
)
def test_prism_cooldown_takes_several_steps_spaced_or_comma_separated(argv):
    from pipeline.cli import build_parser, cooldown, parse_args

    args = parse_args(build_parser(), ["cooldown", "runs/wsds/prism-tiny-s1234", *argv])
    steps, swept_in = cooldown.steps_of(args.from_step)
    assert (steps, [*swept_in, *args.overrides]) == ([36, 72, 144], ["train.device=cpu"])


def test_prism_cooldown_refuses_a_repeated_or_unreadable_step():
    from pipeline.cli import cooldown

    with pytest.raises(ConfigError, match="repeats a step"):
        cooldown.steps_of(["36", "36"])
    with pytest.raises(ConfigError, match=r"give steps, e.g. --from-step 96 192"):
        cooldown.steps_of(["36", "7x"])
