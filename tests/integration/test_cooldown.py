"""Cooldown branches on real tiny runs (issue #40): the same data as the main run after the branch step (2-rank
gloo, batches hashed), an annealed loss below the main run's, an exact resume, the lineage tags `prism compare`
and `prism scaling` read, and every refusal before either folder is touched.

One module fixture trains both arms' WSD main runs (Prism at 2 ranks with its batches hashed, uniform at 1) and
a branch of each from step 4; the tests share them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline.cli import main
from pipeline.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
MAIN_STEPS, BRANCH_STEP, DECAY_STEPS = 12, 4, 4
SMALL = [
    "model.num_layers=4",
    "train.batch_tokens=1024",
    "train.micro_batch_size=2",
    f"train.train_tokens={MAIN_STEPS * 1024}",
    "train.warmup_fraction=0.1",
    "train.lr_schedule=wsd",
    "train.decay_fraction=0.25",  # the main run decays over steps 10-12: constant LR up to step 9
    "train.precision=fp32",
    # A high LR, so that within 12 steps the loss sits at the floor its noise allows: where annealing pays (at the
    # preset's 2e-3 these first steps still descend fast, and a decay there only slows them).
    "train.lr=1e-2",
    "train.log_every=1",
    "train.val_every=2",
    "train.val_tokens=2048",
    "checkpoint.every_steps=2",
    "checkpoint.keep_every_steps=4",  # milestones at 4, 8, 12: the branch points; step 2, 6, 10 are pruned
    "checkpoint.keep_last=1",
    "tracking.system_metrics=false",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_command(config_args: list[str], nproc: int) -> list[str]:
    train = ["-m", "pipeline.cli", "train", *config_args]
    if nproc == 1:
        return [sys.executable, *train]
    run = ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1"]
    return [sys.executable, *run, f"--master-port={free_port()}", *train]


def start(config_args: list[str], nproc: int, **env: str) -> subprocess.Popen:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **env}
    pipe = dict(cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.Popen(train_command(config_args, nproc), **pipe)


def finish(proc: subprocess.Popen, code: int = 0) -> str:
    log, _ = proc.communicate(timeout=400)
    assert proc.returncode == code, f"exit {proc.returncode}, not {code}:\n{log[-4000:]}"
    return log


def cooldown(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipeline.cli", "cooldown", *args]
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)


def hashes(folder: Path) -> dict[int, list[str]]:
    """step -> the sha256 of each micro-batch every rank trained, ranks in order."""
    out: dict[int, list[str]] = {}
    for path in sorted(folder.glob("batches-rank*.txt")):
        for line in path.read_text().splitlines():
            step, digest = line.split()
            out.setdefault(int(step), []).append(digest)
    return out


def listing(*folders: Path) -> dict[str, tuple[int, int]]:
    """Every file under the folders with its size and mtime: what "untouched" compares."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for f in folders if f.exists() for p in f.rglob("*")}


def history(uri: str, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in MlflowClient(uri).get_metric_history(run_id, key)}


@dataclass
class Ladder:
    out: Path
    uri: str
    main: dict[str, Path]  # arm -> main run folder
    branch: dict[str, Path]  # arm -> branch folder
    branch_config: Path  # the Prism branch's config, as `prism cooldown --launch print` wrote it
    main_batches: dict[int, list[str]]
    branch_batches: dict[int, list[str]]
    main_untouched: bool  # both main runs' folders: the same files, sizes and mtimes after their branches trained

    def runs(self) -> dict[str, object]:
        """run name -> its MLflow run."""
        client = MlflowClient(self.uri)
        exp = client.get_experiment_by_name("prism-tiny")
        return {r.info.run_name: r for r in client.search_runs([exp.experiment_id], "tags.kind = 'train'")}


@pytest.fixture(scope="module")
def ladder(tiny_data, tmp_path_factory) -> Ladder:
    out = tmp_path_factory.mktemp("cooldown")
    uri = f"sqlite:///{out / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()  # the store's schema, once: two first writers would race on it
    common = [*tiny_data.overrides, *SMALL, f"run.output_dir={out}"]
    logs = {arm: out / f"batches-{arm}" for arm in ("main", "branch")}
    for folder in logs.values():
        folder.mkdir()
    prism = start(
        ["configs/tiny_prism.yaml", *common, "schedule.heads=6x2,12x2"], 2, PRISM_FAULT_BATCH_LOG=str(logs["main"])
    )
    uniform = start(["configs/tiny_uniform.yaml", *common, "schedule.heads=12x4"], 1)
    finish(prism), finish(uniform)
    main_dirs = {arm: out / f"{arm}-tiny-s1234" for arm in ("prism", "uniform")}
    before = listing(*main_dirs.values())
    printed = cooldown(
        str(main_dirs["prism"]), "--from-step", str(BRANCH_STEP), "--decay-tokens", str(DECAY_STEPS * 1024),
        "--launch", "print",
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    branch_config = Path(printed.stdout.splitlines()[1].split()[-1])
    prism = start([str(branch_config)], 2, PRISM_FAULT_BATCH_LOG=str(logs["branch"]))
    # trains here (--launch local); a decay half the branch's length: 4 steps, like the Prism branch's
    uniform_branch = ["--from-step", str(BRANCH_STEP), "--decay-fraction", "0.5", "--decay-shape", "linear"]
    uniform = cooldown(str(main_dirs["uniform"]), *uniform_branch)
    finish(prism)
    assert uniform.returncode == 0, uniform.stdout[-3000:] + uniform.stderr[-3000:]
    branches = {arm: out / f"{arm}-tiny-s1234-cooldown-{BRANCH_STEP}" for arm in ("prism", "uniform")}
    untouched = listing(*main_dirs.values()) == before
    return Ladder(out, uri, main_dirs, branches, branch_config, hashes(logs["main"]), hashes(logs["branch"]), untouched)


def test_a_branch_reads_the_batches_the_main_run_read_after_its_step(ladder):
    branch_steps = range(BRANCH_STEP + 1, BRANCH_STEP + DECAY_STEPS + 1)
    assert sorted(ladder.branch_batches) == list(branch_steps)
    for step in branch_steps:
        assert len(ladder.branch_batches[step]) == 4  # 2 ranks x grad_accum 2
        assert ladder.branch_batches[step] == ladder.main_batches[step], step
    assert ladder.main_batches[BRANCH_STEP] != ladder.main_batches[BRANCH_STEP + 1]  # the hashes tell steps apart
    assert ladder.main_untouched  # the branches read the main runs' checkpoints and wrote nothing there


def test_a_branch_is_its_own_run_with_lineage_tags(ladder):
    runs = ladder.runs()
    main, branch = runs["prism-tiny-s1234"], runs[f"prism-tiny-s1234-cooldown-{BRANCH_STEP}"]
    assert branch.info.run_id != main.info.run_id
    tags, params = branch.data.tags, branch.data.params
    assert tags["branch_parent_run_id"] == main.info.run_id
    assert tags["branch_step"] == str(BRANCH_STEP) and tags["branch_tokens"] == str(BRANCH_STEP * 1024)
    assert (tags["kind"], tags["arm"], tags["scale"], tags["seed"]) == ("train", "prism", "tiny", "1234")
    assert params["train.lr_schedule"] == "wsd" and params["cooldown.decay_tokens"] == str(DECAY_STEPS * 1024)
    assert "branch_step" not in main.data.tags
    assert (ladder.branch["prism"] / "checkpoints" / "latest").read_text() == f"step-{8:07d}"
    lrs = history(ladder.uri, branch.info.run_id, "train/lr")
    main_lrs = history(ladder.uri, main.info.run_id, "train/lr")
    assert lrs[BRANCH_STEP + 1] < main_lrs[BRANCH_STEP + 1] == main_lrs[BRANCH_STEP]  # decays from the stable LR
    assert lrs[BRANCH_STEP + DECAY_STEPS] == pytest.approx(2e-4)  # train.min_lr at its last step


def test_the_branch_anneals_below_the_main_run_at_the_same_tokens(ladder):
    runs = ladder.runs()
    for arm in ("prism", "uniform"):
        main, branch = runs[f"{arm}-tiny-s1234"], runs[f"{arm}-tiny-s1234-cooldown-{BRANCH_STEP}"]
        end = BRANCH_STEP + DECAY_STEPS
        annealed, constant = history(ladder.uri, branch.info.run_id, "val/loss")[end], None
        constant = history(ladder.uri, main.info.run_id, "val/loss")[end]
        assert annealed < constant, (arm, annealed, constant)


def test_a_branch_killed_mid_way_resumes_exactly(ladder, tmp_path):
    """A second branch like the fixture's, in another folder, crashes at its step 7 (after its step-6
    checkpoint) and is restarted: its losses equal the uninterrupted branch's."""
    once = tmp_path / "crashed-once"
    made = cooldown(
        str(ladder.main["prism"]), "--from-step", str(BRANCH_STEP), "--decay-tokens", str(DECAY_STEPS * 1024),
        "--out", str(tmp_path), "--launch", "print", "tracking.enabled=false", "checkpoint.async_save=false",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    config_path = made.stdout.splitlines()[1].split()[-1]
    finish(start([config_path], 2, PRISM_FAULT_CRASH="7", PRISM_FAULT_ONCE=str(once)), code=1)
    log = finish(start([config_path], 2))
    assert f"resumed from step-{6:07d}" in log
    rows = [json.loads(line) for line in (Path(config_path).parent / "checkpoints" / "metrics.jsonl").open()]
    resumed = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}  # later rows win: the resumed steps
    branch = ladder.runs()[f"prism-tiny-s1234-cooldown-{BRANCH_STEP}"]
    reference = history(ladder.uri, branch.info.run_id, "train/loss")
    for step in range(BRANCH_STEP + 1, BRANCH_STEP + DECAY_STEPS + 1):
        assert resumed[step] == reference[step], step  # bit-identical


def test_compare_shows_the_annealed_points_of_both_arms(ladder, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["compare", "--experiment", "prism-tiny", "--tracking-uri", ladder.uri, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "annealed" in printed.lower()
    line = next(x for x in printed.splitlines() if x.startswith("| tiny |") and f"{8 * 1024:,}" in x)
    assert "uniform" in line or "prism" in line
    assert (out / "annealed_loss_vs_tokens_tiny.png").stat().st_size > 10_000
    assert "| tiny | prism | 6x2,12x2 | 1 |" in printed  # the main table: the main run alone, no branch
    # each main run's own decay is an annealed point at its full tokens, beside its branch
    ends = [x for x in printed.splitlines() if x.startswith(f"| tiny | {MAIN_STEPS * 1024:,} |")]
    assert sorted(x.split(" | ")[2] for x in ends) == ["prism", "uniform"], printed
    assert all("| main run's own decay | 1 |" in x for x in ends), ends


def test_a_sweep_and_prism_cooldown_branch_both_arms_at_several_steps(ladder, tiny_data, tmp_path):
    """A sweep spec's cooldown: section lists one branch per (arm, seed, step), and each branch config, built
    from the preset and the spec's overrides, may start from its main run (pipeline.cooldown.start_point: the
    checkpoint, the resume policy, the data left); prism cooldown --from-step 4 8 writes one branch per step."""
    import yaml

    from pipeline import cooldown as branches
    from pipeline import sweep

    common = [*tiny_data.overrides, *SMALL, f"run.output_dir={ladder.out}"]
    grid = []
    for arm, heads in (("prism", "6x2,12x2"), ("uniform", "12x4")):  # the fixture's main runs
        spec = tmp_path / f"{arm}.yaml"
        spec.write_text(
            yaml.safe_dump(
                {
                    "configs": [str(ROOT / f"configs/tiny_{arm}.yaml")],
                    "seeds": [1234],
                    "overrides": [*common, f"schedule.heads={heads}"],
                    "cooldown": {"from_steps": [BRANCH_STEP, 8], "decay_tokens": DECAY_STEPS * 1024},
                }
            )
        )
        out = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "sweep", str(spec), "--dry-run"], cwd=ROOT, capture_output=True,
            text=True,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        for step in (BRANCH_STEP, 8):
            assert f"-> {arm}-tiny-s1234-cooldown-{step} (decays {DECAY_STEPS} steps)" in out.stdout
        grid += sweep.grid_of_spec(sweep.load_spec(spec))
    before = listing(ladder.out)
    other = grid.pop(2)  # uniform at step 4: the fixture's branch there decays linearly (--decay-shape linear)
    with pytest.raises(ConfigError, match="already holds another branch .cooldown.decay_shape='linear', not None"):
        branches.start_point(other.cfg, dp=None)
    starts = {r.name: branches.start_point(r.cfg, dp=None) for r in grid}
    assert starts[f"prism-tiny-s1234-cooldown-{BRANCH_STEP}"] is None  # the fixture's branch: it would resume
    assert starts["uniform-tiny-s1234-cooldown-8"].source_dir == ladder.main["uniform"] / "checkpoints"
    assert listing(ladder.out) == before  # checking wrote nothing
    printed = cooldown(
        str(ladder.main["prism"]), "--from-step", "4", "8", "--decay-tokens", "2048", "--out", str(tmp_path),
        "--launch", "print", "tracking.enabled=false",
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    written = [line.split()[-1] for line in printed.stdout.splitlines() if line.startswith("prism train ")]
    assert written == [str(tmp_path / f"prism-tiny-s1234-cooldown-{n}" / "cooldown.yaml") for n in (4, 8)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--from-step", "6", "--decay-tokens", "2048"], "no checkpoint at step 6"),
        (["--from-step", "4", "--decay-tokens", "700000", "--out", "{new}"], "run past the"),
        (["--from-step", "4", "--decay-tokens", "2048", "--out", "{new}", "model.ffn_hidden_size=384"], "ffn_hidden"),
        (["--from-step", "4", "--decay-tokens", "2048"], "already holds another branch"),
    ],
    ids=["no-checkpoint", "past-the-data", "another-config", "another-branch"],
)
def test_each_refusal_is_one_line_exit_2_and_touches_nothing(ladder, tmp_path, args, message):
    new = tmp_path / "branches"  # --out: a folder nothing may create
    folders = [ladder.main["prism"], ladder.branch["prism"], ladder.out / "prism-tiny-s1234-cooldown-6", new]
    before = listing(*folders)
    got = cooldown(str(ladder.main["prism"]), *(a.replace("{new}", str(new)) for a in args))
    assert got.returncode == 2, got.stdout + got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], got.stderr
    if message.startswith("no checkpoint"):
        assert "keep_every_steps" in lines[0] and "steps kept: 4 (milestone), 8 (milestone), 12" in lines[0]
    assert listing(*folders) == before
    assert not new.exists() and not (ladder.out / "prism-tiny-s1234-cooldown-6").exists()
