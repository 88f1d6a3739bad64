"""One schedule, one verdict: train, sweep, study and search read a schedule the same way (config.load), so
each accepts or refuses the same spellings: preset names, compact and list forms, and a guideline violation
that is refused unless the config allows it. Search once read schedules on its own and refused preset names
and allowed violations that train accepted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import config, search
from pipeline.config import ConfigError
from pipeline.runs import plan
from pipeline.study import study_runs

ROOT = Path(__file__).resolve().parents[2]
ALLOW = "schedule.allow_guideline_violations=true"


def train(scale: str, heads: str, overrides: list[str]) -> str:
    return config.load(plan.preset_path("prism", scale), [*overrides, f"schedule.heads={heads}"]).schedule.heads


def sweep_verb(scale: str, heads: str, overrides: list[str]) -> str:
    (resolved,) = plan.expand_schedules([heads], "prism", scale, overrides)
    return resolved


def study(scale: str, heads: str, overrides: list[str]) -> str:
    (run,) = study_runs([str(plan.preset_path("prism", scale))], [1], [*overrides, f"schedule.heads={heads}"])
    return run.cfg.schedule.heads


def search_verb(scale: str, heads: str, overrides: list[str], tmp_path: Path) -> str:
    spec = tmp_path / "spec.yaml"
    batch = config.load(plan.preset_path("prism", scale)).train.batch_tokens  # rungs of whole steps
    spec.write_text(
        f"config: {plan.preset_path('prism', scale)}\n"
        f"overrides: {json.dumps(overrides)}\n"
        f"space: {{schedules: [{json.dumps(heads)}]}}\n"
        f"rungs: {{min_tokens: {batch}, reduction_factor: 2, full_tokens: {4 * batch}}}\n"
    )
    (resolved,) = search.load_spec(spec).schedules
    return resolved


def verdict(verb, *args) -> str:
    try:
        return verb(*args)
    except ConfigError:
        return "refused"


@pytest.mark.parametrize(
    "scale, heads, overrides, want",
    [
        ("124m", "paper-124m", [], "3x2,6x2,8x2,12x6"),  # a preset name
        ("tiny", "3x2,6x2,12x4", [], "3x2,6x2,12x4"),  # compact
        ("tiny", "[3, 3, 6, 6, 12, 12, 12, 12]", [], "3x2,6x2,12x4"),  # the list spelling
        ("tiny", "3x1,6x3,12x4", [], "refused"),  # a 1-layer stage: a guideline (Table 5's kind of ablation)
        ("tiny", "3x1,6x3,12x4", [ALLOW], "3x1,6x3,12x4"),  # ... which the config may allow
        ("tiny", "6x2,3x2,12x4", [ALLOW], "refused"),  # a hard rule: never allowed
        ("tiny", "paper-124m", [], "refused"),  # a preset of another depth
    ],
)
def test_every_verb_gives_a_schedule_the_same_verdict(tmp_path, scale, heads, overrides, want):
    verdicts = {
        "train": verdict(train, scale, heads, overrides),
        "sweep": verdict(sweep_verb, scale, heads, overrides),
        "study": verdict(study, scale, heads, overrides),
        "search": verdict(search_verb, scale, heads, overrides, tmp_path),
    }
    assert verdicts == dict.fromkeys(verdicts, want)
