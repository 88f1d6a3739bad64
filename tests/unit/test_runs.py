"""pipeline.runs: the grid every policy plans (order, overrides, run folders, the `prism train` command) and the
local pool the demo and the study launch through (how many at once, the cores shared, how each run ended)."""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.runs.plan import expand_grid

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_prism.yaml"


def test_the_grid_is_seed_major_and_gives_each_schedule_its_own_folder(tmp_path):
    runs = expand_grid([TINY], [1, 2], ["3x2,6x2,12x4", "6x2,12x6"], [f"run.output_dir={tmp_path}"])
    assert [(r.cfg.run.seed, r.schedule) for r in runs] == [
        (1, "3x2,6x2,12x4"),
        (1, "6x2,12x6"),
        (2, "3x2,6x2,12x4"),
        (2, "6x2,12x6"),
    ]
    # one run name per arm and seed, so the schedule is in the folder: two schedules never share a run dir
    assert runs[0].name == runs[1].name == "prism-tiny-s1"
    assert runs[0].run_dir == tmp_path / "sched-3x2_6x2_12x4" / "prism-tiny-s1"
    assert len({r.run_dir for r in runs}) == 4
    assert runs[1].label == "prism-tiny-s1 6x2,12x6"
    # the command trains exactly the config the grid loaded
    cmd = runs[3].train_command()
    assert cmd[:8] == [sys.executable, "-m", "pipeline.cli", "train", str(TINY), f"run.output_dir={tmp_path}"] + [
        "run.seed=2",
        "schedule.heads=6x2,12x6",
    ]
    assert f"run.output_dir={tmp_path}/sched-6x2_12x6" in cmd
    # the run moves to the schedule's folder; its data (training, tokenizer, every validation set) stays put
    d = runs[3].cfg.data
    assert d.dataset_dir == str(tmp_path / "data" / "embedded-bpe8k-256")
    assert d.tokenizer == str(tmp_path / "data" / "embedded-bpe8k.json")
    assert d.val_sets["heldout"].dataset_dir == str(tmp_path / "data" / "embedded-heldout-bpe8k-256")
    assert d.val_sets["heldout"].input == str(tmp_path / "data" / "embedded-heldout-corpus")


def test_without_seeds_or_schedules_each_config_keeps_its_own():
    (run,) = expand_grid([TINY], overrides=["run.seed=7"])
    assert run.cfg.run.seed == 7 and run.schedule is None and run.label == "prism-tiny-s7"
    assert run.train_command()[-2:] == [str(TINY), "run.seed=7"]


def test_local_runs_share_the_cores_one_way(monkeypatch):
    """The demo, the study and local search trials start `prism train` through one rule for threads."""
    from pipeline import distributed

    monkeypatch.setattr(distributed, "node_cpus", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = distributed.local_run_env(3)
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"], env["PYTHONUNBUFFERED"]) == ("2", "2", "1")
    assert "OMP_NUM_THREADS" not in distributed.local_run_env(1)  # alone: the libraries' own counts
    assert distributed.local_run_env(16)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert distributed.local_run_env(2)["OMP_NUM_THREADS"] == "3"  # the user's choice wins over a share
    assert distributed.local_run_env(2, threads=1)["OMP_NUM_THREADS"] == "1"  # a fixed count (the demo) wins


def test_the_local_pool_runs_at_most_its_share_at_once_and_reports_each_ending(tmp_path):
    """Each command marks its start and end in one file; the first two wait for each other (so they must run
    side by side), never more than two overlap, and every exit code reaches its on_exit, failures included."""
    from pipeline.runs.launch import LocalPool

    trace = tmp_path / "trace"
    script = (
        "import sys, time\n"
        "path, code = sys.argv[1], int(sys.argv[2])\n"
        "with open(path, 'a') as f: f.write('+ ')\n"
        "deadline = time.monotonic() + 20\n"
        "while open(path).read().count('+') < 2 and time.monotonic() < deadline: time.sleep(0.05)\n"
        "time.sleep(0.2)\n"
        "with open(path, 'a') as f: f.write('- ')\n"
        "sys.exit(code)\n"
    )
    pool, ended = LocalPool(2), []
    for code in (0, 3, 0, 5):
        pool.start([sys.executable, "-c", script, str(trace), str(code)], lambda rc, c=code: ended.append((c, rc)))
    pool.wait()
    assert sorted(ended) == [(0, 0), (0, 0), (3, 3), (5, 5)]
    depth, deepest = 0, 0
    for mark in trace.read_text().split():
        depth += 1 if mark == "+" else -1
        deepest = max(deepest, depth)
    assert deepest == 2  # two side by side, never three
