"""The restart policy (pipeline/restart.py) as a table, the job script's calls into it (launchers/recovery.py),
the one signal list and grace rule (pipeline/signals.py), and the fault injection the recovery tests drive it
with (pipeline/faults.py)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from pipeline.exit_codes import EXIT_BAD_INPUT, EXIT_CRASHED, EXIT_INFRA, EXIT_NONFINITE, EXIT_STOPPED
from pipeline.restart import DONE, NOT_STARTED, REQUEUE, RESTART, STOP, decide

WHERE = "/runs/x/checkpoints/diagnostics"
ROOT = Path(__file__).resolve().parents[2]


def job_args(tmp_path: Path) -> list[str]:
    """CONFIG and overrides of a tiny run in ``tmp_path``, as the job script passes them."""
    overrides = ["train.batch_tokens=1024", "train.micro_batch_size=2", "train.train_tokens=6144"]
    return [str(ROOT / "configs/tiny_prism.yaml"), f"run.output_dir={tmp_path}", *overrides]


# record, step exit status, a stop signal arrived, history, latest -> action, exit status, counts at, in the line
POLICY = [
    # the budget is done, also when a late signal killed torchrun after the final checkpoint (138)
    (("finished", 9), 0, False, [], 9, DONE, 0, None, "training finished"),
    (("finished", 9), 138, True, [], 9, DONE, 0, None, "after the final checkpoint (step exit 138)"),
    (None, 0, False, [], 9, DONE, 0, None, "training finished"),  # the record could not be written
    # a checkpoint for a stop signal: requeue, whatever torchrun's status says
    (("signal", 5), 1, True, [], 5, REQUEUE, EXIT_STOPPED, None, "checkpointed at step 5 after a stop signal"),
    (("signal", 5), 138, False, [], 5, REQUEUE, EXIT_STOPPED, None, "requeueing"),
    # retrying cannot help: stop, also after a stop signal, though srun's status is 1 for any failed worker
    (("nonfinite", 4), 1, True, [], 2, STOP, EXIT_NONFINITE, None, "NaN/inf"),
    (("nonfinite", 4), 1, False, [], 2, STOP, EXIT_NONFINITE, None, "not retrying"),
    (("bad_input", 0), 1, True, [], 0, STOP, EXIT_BAD_INPUT, None, "bad input"),
    # a crash, an infra fault or a lost step restart within the bound, counted at their step
    (("crashed", 7), 1, False, [], 6, RESTART, 0, 7, "restart 1 of 3 (PRISM_MAX_RESTARTS) from latest, step 6"),
    (("infra", 12), 1, False, [7], 10, RESTART, 0, 12, "restart 2 of 3"),
    (None, 137, False, [], 40, RESTART, 0, 40, "without an exit record"),
    # the same step again after a restart: a crash loop, at once
    (("infra", 12), 1, False, [7, 12], 10, STOP, EXIT_INFRA, 12, "crash loop: step 12"),
    (None, 137, False, [40], 40, STOP, 137, 40, "crash loop: step 40"),  # no checkpoint since
    # different steps each time: the bound stops it
    (("crashed", 20), 1, False, [7, 12, 15], 18, STOP, EXIT_CRASHED, 20, "all 3 restarts are used"),
    # a stop signal between a crash and the next start: requeue (counted), not a restart into the time limit
    (("crashed", 7), 1, True, [], 6, REQUEUE, EXIT_STOPPED, 7, "then a stop signal; restart 1 of 3"),
    (("crashed", 7), 1, True, [7], 6, STOP, EXIT_CRASHED, 7, "crash loop"),  # a loop stays a loop
    # a stop signal after the crash's verdict (a restart) and before the next start: requeue, no start
    (None, NOT_STARTED, True, [7], 6, REQUEUE, EXIT_STOPPED, None, "before the restart"),
    # the signal killed the step before the trainer could checkpoint: requeue, not a failure
    (None, 138, True, [], 4, REQUEUE, EXIT_STOPPED, None, "before the trainer could checkpoint"),
]


@pytest.mark.parametrize("record,status,signaled,history,latest,action,exit_status,counts,says", POLICY)
def test_the_restart_policy(record, status, signaled, history, latest, action, exit_status, counts, says):
    v = decide(record, status, signaled, history, latest, max_restarts=3, where=WHERE)
    assert (v.action, v.exit_status, v.failed_at) == (action, exit_status, counts), v
    assert says in v.line and "\n" not in v.line, v.line
    assert v.line.startswith("error:") == (action == STOP), v.line
    if action == STOP and counts is not None:
        assert WHERE in v.line  # where to look


def test_a_launcher_that_does_not_requeue_stops_with_its_reason():
    for record, status, signaled in ((("signal", 5), 1, False), (("crashed", 7), 1, True), (None, 138, True)):
        v = decide(record, status, signaled, [], 5, no_requeue="PRISM_REQUEUE=0")
        assert v.action == STOP and "not requeueing (PRISM_REQUEUE=0)" in v.line, v
    assert decide(("crashed", 7), 1, True, [], 5, no_requeue="x").exit_status == EXIT_CRASHED
    assert decide(("crashed", 3), 1, False, [], 2, max_restarts=0).action == STOP  # PRISM_MAX_RESTARTS=0: never


def test_the_verdict_call_keeps_the_history_and_clears_it_when_done(tmp_path, monkeypatch, capsys):
    from launchers import recovery

    args = job_args(tmp_path)
    history, record = tmp_path / "job.failures", tmp_path / "job.exit"
    record.write_text("crashed 3\n")
    assert recovery.main(["verdict", str(history), "1", "0", str(record), *args]) == 0
    action, status, line = capsys.readouterr().out.strip().split(" ", 2)
    assert (action, status) == (RESTART, "0") and "restart 1 of 3" in line and history.read_text() == "3\n"
    assert recovery.main(["verdict", str(history), "1", "0", str(record), *args]) == 0  # step 3 again
    assert capsys.readouterr().out.startswith(f"{STOP} {EXIT_CRASHED} error: crash loop: step 3")
    monkeypatch.setenv("PRISM_MAX_RESTARTS", "many")
    assert recovery.main(["verdict", str(history), "1", "0", str(record), *args]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{STOP} {EXIT_BAD_INPUT} error: PRISM_MAX_RESTARTS='many'") and out.count("\n") == 1
    monkeypatch.delenv("PRISM_MAX_RESTARTS")
    record.write_text("finished 8\n")
    assert recovery.main(["verdict", str(history), "0", "0", str(record), *args]) == 0
    assert capsys.readouterr().out.startswith(f"{DONE} 0 ") and not history.exists()


@pytest.fixture
def faults(monkeypatch):
    def load(**env):
        for key in ("PRISM_FAULT_CRASH", "PRISM_FAULT_HANG", "PRISM_FAULT_ONCE"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        import pipeline.faults

        return importlib.reload(pipeline.faults)

    yield load
    monkeypatch.delenv("PRISM_FAULT_CRASH", raising=False)
    monkeypatch.delenv("PRISM_FAULT_ONCE", raising=False)
    import pipeline.faults

    importlib.reload(pipeline.faults)


def test_faults_fire_only_where_asked_and_once_with_a_marker(faults, monkeypatch, tmp_path):
    unset = faults()
    assert unset.before_step is unset._nothing  # unset: the loop calls a function that does nothing
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    f = faults(PRISM_FAULT_CRASH="3")  # default rank: the last
    f.before_step(2)
    with pytest.raises(f.InjectedFault, match="step 3 on rank 1"):
        f.before_step(3)
    f = faults(PRISM_FAULT_CRASH="3:0")
    f.before_step(3)  # rank 0's fault, we are rank 1
    f = faults(PRISM_FAULT_CRASH="3", PRISM_FAULT_ONCE=str(tmp_path / "fired"))
    with pytest.raises(f.InjectedFault):
        f.before_step(3)
    f.before_step(3)  # the restarted run passes the step
    assert (tmp_path / "fired").exists()


def test_the_exit_record_has_one_reader(tmp_path):
    from pipeline.exit_codes import RECORD_REASONS, parse_exit_record

    for code, reason in RECORD_REASONS.items():
        assert parse_exit_record(f"{reason} 12\n") == (reason, 12), code
    for torn in ("", "finished", "finished x", "exploded 3", "signal 3 extra"):
        assert parse_exit_record(torn) is None, torn
    # the policy reads a torn record as none: the step `latest` names (none here: 0) counts
    from pipeline import config
    from pipeline.restart import judge

    cfg = config.load(job_args(tmp_path)[0], job_args(tmp_path)[1:])
    assert judge("crashed", 1, False, tmp_path / "h", cfg, {}).failed_at == 0


def test_a_sweep_job_checkpoints_when_torchrun_died_of_the_same_signal(tmp_path):
    """scancel's signal reaches torchrun as well as submitit: torchrun can be dead, unreaped, when the handler
    runs; Popen.send_signal then reaps it, and the handler must still hand submitit its requeue."""
    import os
    import subprocess
    import sys

    from pipeline.runs.launch import TrainJob

    job = TrainJob("configs/tiny_prism.yaml", ["train.seed=3"], grace_s=1)
    job._proc = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, job._proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    assert job._proc.returncode is None
    requeued = job.checkpoint()
    assert job._proc.returncode == 0
    assert requeued.function is job and "_proc" not in job.__getstate__()


def test_one_signal_list_and_one_grace_rule_for_torchrun_the_job_script_and_submitit(tmp_path, capsys):
    from launchers import recovery
    from pipeline import signals
    from pipeline.signals import torchrun_env

    default = torchrun_env(150, {})
    forwarded = default["PET_SIGNALS_TO_HANDLE"].split(",")
    assert set(signals.STOP_SIGNALS) <= set(forwarded) and signals.ASK_TO_STOP in signals.STOP_SIGNALS
    assert default["TORCHELASTIC_SIGNALS_TO_HANDLE"] == default["PET_SIGNALS_TO_HANDLE"]
    assert default["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "150"
    # a list the user exported under either name reaches both readers
    for name in ("PET_SIGNALS_TO_HANDLE", "TORCHELASTIC_SIGNALS_TO_HANDLE"):
        mine = torchrun_env(5, {name: "SIGTERM,SIGUSR1"})
        assert mine["PET_SIGNALS_TO_HANDLE"] == mine["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGUSR1", name
    # the grace: the signal's lead less the requeue's margin, for the job script as for submitit jobs
    assert signals.job_grace({}) == signals.shutdown_grace(signals.DEFAULT_SIGNAL_LEAD_S) == 150
    assert signals.job_grace({"PRISM_SIGNAL_LEAD": "300"}) == signals.shutdown_grace(300) == 270
    assert signals.job_grace({"PRISM_SHUTDOWN_GRACE": "5", "PRISM_SIGNAL_LEAD": "300"}) == 5

    args = job_args(tmp_path)
    assert recovery.main(["prepare", "1", "1", *args]) == 0
    env = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines())
    assert env["PRISM_TRAP_SIGNALS"].split() == [s.removeprefix("SIG") for s in signals.STOP_SIGNALS]
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "150" and env["PRISM_LAYOUT"].startswith("layout: 1 node(s)")
    assert env["TORCH_FR_DUMP_TEMP_FILE"].endswith("diagnostics/nccl_trace_rank_")
    assert recovery.main(["prepare", "2", "3", *args, "parallel.tp=2"]) == 2  # world 6, TP 2 straddles nodes
    for bad in ("PRISM_SHUTDOWN_GRACE", "PRISM_SIGNAL_LEAD"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(bad, "soon")
            capsys.readouterr()
            assert recovery.main(["prepare", "1", "1", *args]) == 2
            out, err = capsys.readouterr()
            assert out == "" and err.count("\n") == 1 and f"{bad}='soon'" in err
