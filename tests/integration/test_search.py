"""`prism search`: a tiny ASHA search over 6 schedules with real `prism train` runs. On the local executor
its driver is killed (SIGKILL) mid-search and resumed, then the confirmation stage runs; one search serves
those checks, to keep CI time low. On the local two-node Slurm cluster every trial is a submitit job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import search
from pipeline.runs import launch, outcome

ROOT = Path(__file__).resolve().parents[2]
# Each step of rank 0 sleeps 0.5 s (a slow data fetch), so a trial outlives the driver's look at its last
# pruning rung by several steps: a pruned trial must end by its stop signal, before its full budget.
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PRISM_FAULT_SLOW_RANK": "0:0.5"}
SCHEDULES = ["2x2,6x2,12x4", "4x2,8x2,12x4", "3x2,4x2,12x4", "6x2,8x2,12x4", "2x2,4x2,12x4", "3x2,8x2,12x4"]


def _spec(
    tmp_path: Path,
    tiny_data,
    name: str = "tiny-search",
    executor: str = "local",
    more_overrides: tuple[str, ...] = (),
    **changes: str,
) -> Path:
    overrides = "\n".join(f"  - {o}" for o in [*tiny_data.overrides, *more_overrides])
    text = f"""name: {name}
config: {ROOT / "configs/tiny_prism.yaml"}
folder: {tmp_path / "search"}
overrides:
{overrides}
  - train.batch_tokens=1024
  - train.micro_batch_size=8
  - train.val_tokens=1024
  - train.log_every=1
  - checkpoint.every_steps=100
  - tracking.system_metrics=false
space:
  schedules: {json.dumps(SCHEDULES)}
rungs: {{min_tokens: 3072, reduction_factor: 2, full_tokens: 12288}}
trials: 6
concurrency: 2
seed: 0
executor: {executor}
"""
    for key, value in changes.items():
        text += f"{key}: {value}\n"
    path = tmp_path / "tiny-search.yaml"
    path.write_text(text)
    return path


def _state(folder: Path) -> dict:
    path = folder / search.STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else {"runs": {}}


def _processes_in(folder: Path) -> list[int]:
    """Live processes whose command line names something inside ``folder``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(folder).encode() in (entry / "cmdline").read_bytes() and launch.proc_start(int(entry.name)):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.fixture(scope="module")
def killed_and_resumed(tiny_data, tmp_path_factory):
    """The search, its driver SIGKILLed once a trial ended and two run, then `--resume`d to the end."""
    tmp = tmp_path_factory.mktemp("search")
    spec = _spec(tmp, tiny_data, confirm="{top_k: 1, seeds: 2}")
    folder = tmp / "search"
    cmd = [sys.executable, "-m", "pipeline.cli", "search", str(spec), "--poll-s", "0.5"]
    with open(tmp / "first.log", "w") as log:
        first = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and first.poll() is None:
        runs = _state(folder)["runs"].values()
        if any(r["status"] in search.FINAL for r in runs) and sum(r["status"] == "running" for r in runs) >= 1:
            break
        time.sleep(0.2)
    assert first.poll() is None, (tmp / "first.log").read_text()[-3000:]
    first.send_signal(signal.SIGKILL)
    first.wait()
    at_kill = {k: dict(r) for k, r in _state(folder)["runs"].items()}
    alive_at_kill = [k for k, r in at_kill.items() if r["handle"] and launch.proc_start(r["handle"]["pid"])]
    resumed = subprocess.run([*cmd, "--resume"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=400)
    return {
        "spec": spec,
        "folder": folder,
        "at_kill": at_kill,
        "alive_at_kill": alive_at_kill,
        "first_log": (tmp / "first.log").read_text(),
        "resumed": resumed,
        "state": _state(folder),
    }


def test_search_prunes_with_checkpoints_leaves_no_process_and_picks_the_best(killed_and_resumed):
    out, state, folder = killed_and_resumed["resumed"], killed_and_resumed["state"], killed_and_resumed["folder"]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    trials = [r for r in state["runs"].values() if r["kind"] == "trial"]
    assert sorted(r["key"] for r in trials) == [f"t{i:03d}" for i in range(6)]
    assert sorted(r["schedule"] for r in trials) == sorted(SCHEDULES)  # the grid sampler: each schedule once
    pruned = [r for r in trials if r["status"] == "pruned"]
    complete = [r for r in trials if r["status"] == "complete"]
    assert pruned and complete and len(pruned) + len(complete) == 6, [(r["key"], r["status"]) for r in trials]
    for r in pruned:  # stopped by the driver's signal: ended through prism train's checkpoint path
        ckpt = Path(r["checkpoint_dir"])
        assert r["checkpoints"] and (ckpt / "latest").read_text().strip() == r["checkpoints"][-1], r
        reason, step = (Path(r["folder"]) / outcome.EXIT_FILE).read_text().split()
        assert reason == "signal" and int(step) == int(r["checkpoints"][-1].split("-")[1]), r
        assert r["tokens"] < 12288, r
    for r in complete:
        assert r["tokens"] == 12288 and r["checkpoints"][-1] == "step-0000012"
    assert _processes_in(folder) == []

    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    from optuna.trial import TrialState

    study = optuna.load_study(
        study_name="tiny-search", storage=JournalStorage(JournalFileBackend(str(folder / search.OPTUNA_FILE)))
    )
    lowest = min(complete, key=lambda r: r["final_val"])
    assert study.best_trial.number == lowest["trial"] and study.best_value == lowest["final_val"]
    states = {t.number: t.state for t in study.trials}
    assert states == {r["trial"]: TrialState.PRUNED if r["status"] == "pruned" else TrialState.COMPLETE for r in trials}
    # the final val loss Optuna holds is the one MLflow holds for that run
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    history = client.get_metric_history(outcome.run_id_of(lowest), "val/loss")
    assert max(history, key=lambda m: m.step).value == pytest.approx(lowest["final_val"])
    # each trial's run was made a child of the search's parent run, named for the trial, before it started
    runs = client.search_runs([client.get_experiment_by_name("tiny-search").experiment_id], max_results=100)
    [parent] = [r for r in runs if r.data.tags.get("kind") == "search"]
    children = {r.data.tags.get("search.trial"): r for r in runs if r.data.tags.get("kind") == "train"}
    assert sorted(children) == [str(r["trial"]) for r in sorted(trials, key=lambda r: r["trial"])]
    for r in trials:
        child = children[str(r["trial"])]
        assert child.info.run_id == outcome.run_id_of(r), r["key"]
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.info.run_name == f"tiny-search-{r['key']}"
    assert "| trial | schedule |" in out.stdout and (folder / "results.png").is_file()


def test_killed_driver_resumes_the_same_trials_without_duplicates(killed_and_resumed):
    k = killed_and_resumed
    out, state, folder = k["resumed"], k["state"], k["folder"]
    assert out.returncode == 0, out.stderr[-3000:]
    assert k["alive_at_kill"], "the driver was killed while no trial ran; the test did not test a resume"
    for key in k["alive_at_kill"]:  # found again, not restarted: same pid, one launch line
        assert state["runs"][key]["handle"] == k["at_kill"][key]["handle"]
        mine = [line for line in out.stdout.splitlines() if line.startswith(f"  {key} [")]
        assert mine and "still running" in mine[0] or "ended meanwhile" in mine[0], mine
        assert not any(": launched," in line for line in mine), mine
    for key, r in k["at_kill"].items():
        if r["status"] in search.FINAL:
            assert state["runs"][key]["status"] == r["status"] and f"  {key} [" not in out.stdout.split("## Search")[0]
    # each trial started once: launched, or found running when the kill fell between its launch and its record
    starts = [line for line in (k["first_log"] + out.stdout).splitlines() if ": launched, pid" in line]
    starts += [line for line in out.stdout.splitlines() if ": found running, pid" in line]
    starts = [line for line in starts if not line.split()[0].startswith("c-")]  # the confirmation's runs
    assert sorted(line.split()[0] for line in starts) == [f"t{i:03d}" for i in range(6)], starts

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tiny-search")
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parents = [r for r in runs if r.data.tags.get("kind") == "search"]
    trials = [r for r in runs if r.data.tags.get("kind") == "train"]
    assert len(parents) == 1 and len(trials) == 6, [(r.info.run_name, r.data.tags.get("kind")) for r in runs]
    assert sorted(r.data.tags["search.trial"] for r in trials) == [str(i) for i in range(6)]
    assert {r.data.tags["mlflow.parentRunId"] for r in trials} == {parents[0].info.run_id}
    for r in state["runs"].values():  # one MLflow run per trial folder, however often its journal restarted
        starts = [x for x in outcome.read_journal(r) if x["op"] == "start"]
        assert len(starts) == 1, (r["key"], len(starts))

    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    study = optuna.load_study(
        study_name="tiny-search", storage=JournalStorage(JournalFileBackend(str(folder / search.OPTUNA_FILE)))
    )
    assert len(study.trials) == 6 and sorted(t.params["schedule"] for t in study.trials) == sorted(SCHEDULES)


def test_confirmation_runs_the_best_schedule_and_uniform_over_seeds_and_compares_them(killed_and_resumed):
    out, state, folder = killed_and_resumed["resumed"], killed_and_resumed["state"], killed_and_resumed["folder"]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    complete = [r for r in state["runs"].values() if r["kind"] == "trial" and r["status"] == "complete"]
    best = min(complete, key=lambda r: r["final_val"])["schedule"]  # top_k 1
    confirm = [r for r in state["runs"].values() if r["kind"] == "confirm"]

    def setting(r: dict, key: str) -> str:
        return next(o.split("=", 1)[1] for o in reversed(r["overrides"]) if o.startswith(key + "="))

    ran = sorted((setting(r, "run.arm"), setting(r, "schedule.heads"), setting(r, "run.seed")) for r in confirm)
    assert ran == [("prism", best, "1"), ("prism", best, "2"), ("uniform", "12x8", "1"), ("uniform", "12x8", "2")]
    assert [r["status"] for r in confirm] == ["complete"] * 4, [(r["key"], r["status"]) for r in confirm]
    # each run its own folder (the marker a driver finds a process by, its exit record, its log): a seed
    # that shared its arm's folder was taken for the other seed's running process and never started
    assert len({r["folder"] for r in confirm}) == len({r["marker"] for r in confirm}) == 4

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tiny-search-confirm")
    runs = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("kind") == "train"]
    assert sorted(r.info.run_name for r in runs) == [
        "prism-tiny-s1",
        "prism-tiny-s2",
        "uniform-tiny-s1",
        "uniform-tiny-s2",
    ]
    assert all(r.info.status == "FINISHED" for r in runs)
    # prism compare's table over them: the prism row against uniform, with a 95 % interval and a p-value
    import csv

    rows = list(csv.DictReader((folder / "confirm" / "compare" / "comparison.csv").open()))
    assert sorted((r["arm"], r["runs"]) for r in rows) == [("prism", "2"), ("uniform", "2")], rows
    [prism] = [r for r in rows if r["arm"] == "prism"]
    low, high, p = float(prism["delta_ci95_low"]), float(prism["delta_ci95_high"]), float(prism["delta_p_value"])
    assert low < float(prism["delta_vs_uniform"]) < high and 0 <= p <= 1, prism
    assert "## Arms comparison: tiny-search-confirm" in out.stdout and "[95 % CI]" in out.stdout


def test_bad_search_spec_is_one_line_with_its_place_and_exit_2(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("config: configs/tiny_prism.yaml\nspace: {schedules: all-valid}\nrungs: {min_tokens: 0}\n")
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "search", str(spec), "--dry-run"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"{spec}:3:8: rungs.reduction_factor is missing" in out.stderr, out.stderr


def test_slurm_search_cancels_pruned_jobs_after_their_checkpoint_and_leaves_nothing_running(
    slurm_cluster, mlflow_server, tiny_data, tmp_path
):
    """The same tiny search on the two-node Slurm cluster, each trial a submitit job, its driver killed once
    and resumed: a pruned trial is scancel'ed through submitit and its job ends CANCELLED after `prism train`
    wrote its checkpoint; a job running at the kill is found again, not submitted twice."""
    spec = _spec(
        tmp_path,
        tiny_data,
        name="slurm-search",
        executor="slurm",
        more_overrides=(f"tracking.uri={mlflow_server.url}",),
        nproc_per_node="1",
        slurm="{cpus_per_task: 1, timeout_min: 10, signal_delay_s: 60}",
    )
    folder = tmp_path / "search"
    cmd = [sys.executable, "-m", "pipeline.cli", "search", str(spec), "--poll-s", "0.5"]
    t0 = time.monotonic()
    # the driver SIGKILLed once a trial ended while another's job runs, then resumed: the job is found again
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    while time.monotonic() - t0 < 240 and first.poll() is None:
        runs = _state(folder)["runs"].values()
        if any(r["status"] in search.FINAL for r in runs) and any(r["status"] == "running" for r in runs):
            break
        time.sleep(0.2)
    assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
    first.send_signal(signal.SIGKILL)
    first.wait()
    at_kill = {k: r["handle"] for k, r in _state(folder)["runs"].items() if r["status"] == "running"}
    out = subprocess.run([*cmd, "--resume"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=420)
    print(f"slurm search: {time.monotonic() - t0:.1f} s\n{out.stdout}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    state = _state(folder)
    assert at_kill and all(state["runs"][k]["handle"] == job for k, job in at_kill.items())
    trials = [r for r in state["runs"].values() if r["kind"] == "trial"]
    assert sorted(r["schedule"] for r in trials) == sorted(SCHEDULES)
    pruned = [r for r in trials if r["status"] == "pruned"]
    complete = [r for r in trials if r["status"] == "complete"]
    assert pruned and complete and len(pruned) + len(complete) == 6, [(r["key"], r["status"]) for r in trials]
    jobs = {r["key"]: r["handle"]["job_id"] for r in trials}
    # one job per trial, none submitted twice: submitit keeps a folder per job it submitted
    submitted = sorted(p.name for p in (folder / "submitit").iterdir() if p.is_dir())
    assert submitted == sorted(jobs.values()), (submitted, jobs)
    for r in pruned:  # cancelled, after the trainer checkpointed at the step the stop landed on
        assert slurm_cluster.sacct(jobs[r["key"]]) == "CANCELLED", r
        ckpt = Path(r["checkpoint_dir"])
        assert r["checkpoints"] and (ckpt / "latest").read_text().strip() == r["checkpoints"][-1], r
        assert int(r["checkpoints"][-1].split("-")[1]) < 12, r
        finish = [x for x in outcome.read_journal(r) if x["op"] == "finish"]
        assert finish and finish[-1]["status"] == "KILLED", (r["key"], finish)
    for r in complete:
        assert slurm_cluster.sacct(jobs[r["key"]]) == "COMPLETED", r
        assert r["tokens"] == 12288 and r["checkpoints"][-1] == "step-0000012"
    # nothing left: no job queued or running, no srun/torchrun/trainer naming the search's folder
    assert all(slurm_cluster.state(job) == "" for job in jobs.values())
    deadline = time.monotonic() + 35  # a cancelled job's steps are SIGKILLed after KillWait (30 s) at worst
    while _processes_in(folder) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_in(folder) == []

    import optuna
    from mlflow.tracking import MlflowClient
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    study = optuna.load_study(
        study_name="slurm-search", storage=JournalStorage(JournalFileBackend(str(folder / search.OPTUNA_FILE)))
    )
    lowest = min(complete, key=lambda r: r["final_val"])
    assert study.best_trial.number == lowest["trial"]
    assert len(study.trials) == 6
    client = MlflowClient(mlflow_server.url)
    runs = client.search_runs([client.get_experiment_by_name("slurm-search").experiment_id], max_results=100)
    [parent] = [r for r in runs if r.data.tags.get("kind") == "search"]
    children = [r for r in runs if r.data.tags.get("kind") == "train"]
    # one MLflow run per trial, the kill notwithstanding, each a child of the search's one parent run
    assert sorted(r.data.tags["search.trial"] for r in children) == [str(i) for i in range(6)]
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    history = client.get_metric_history(outcome.run_id_of(lowest), "val/loss")
    assert max(history, key=lambda m: m.step).value == pytest.approx(study.best_value)
    finals = {r["key"]: r["final_val"] for r in complete}
    assert f"Best: {lowest['key']} {lowest['schedule']}" in out.stdout, finals
