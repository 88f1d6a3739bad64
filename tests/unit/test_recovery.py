"""The restart decision of launchers/train_job.sh (launchers/recovery.py) and the fault injection the recovery
tests drive it with (pipeline/faults.py)."""

from __future__ import annotations

import importlib

import pytest

from launchers.recovery import decide
from pipeline.exit_codes import EXIT_CRASHED, EXIT_INFRA

WHERE = "/runs/x/checkpoints/diagnostics"


def test_a_crash_restarts_until_the_bound_and_a_crash_loop_stops_at_once():
    first = decide("crashed 7", 1, [], latest_step=6, max_restarts=3, where=WHERE)
    assert first.restart and first.step == 7 and "restart 1 of 3" in first.line and "step 6" in first.line
    # progress since: another step fails, restart 2
    assert decide("infra 12", 1, [7], 10, 3, WHERE).restart
    # the same step again after a restart: a crash loop, one line naming the step and the diagnostics
    loop = decide("infra 12", 1, [7, 12], 10, 3, WHERE)
    assert not loop.restart and loop.exit_status == EXIT_INFRA
    assert "crash loop: step 12" in loop.line and WHERE in loop.line and "\n" not in loop.line
    # different steps each time: the bound stops it
    bound = decide("crashed 20", 1, [7, 12, 15], 18, 3, WHERE)
    assert not bound.restart and bound.exit_status == EXIT_CRASHED and "all 3 restarts" in bound.line
    assert WHERE in bound.line
    assert not decide("crashed 3", 1, [], 2, 0, WHERE).restart  # PRISM_MAX_RESTARTS=0: never


def test_a_step_killed_without_an_exit_record_counts_at_the_latest_checkpoint():
    lost = decide("", 137, [], latest_step=40, max_restarts=3, where=WHERE)
    assert lost.restart and lost.step == 40 and "without an exit record" in lost.line
    again = decide("", 137, [40], 40, 3, WHERE)  # no checkpoint since: no progress, a loop
    assert not again.restart and again.exit_status == 137 and "crash loop: step 40" in again.line


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


def test_the_exit_record_has_one_reader():
    from pipeline.exit_codes import RECORD_REASONS, parse_exit_record

    for code, reason in RECORD_REASONS.items():
        assert parse_exit_record(f"{reason} 12\n") == (reason, 12), code
    for torn in ("", "finished", "finished x", "exploded 3", "signal 3 extra"):
        assert parse_exit_record(torn) is None, torn
    # the job script's restart decision reads a torn record as none: the step `latest` names counts
    assert decide("crashed", 1, [], 6, 3, "d").step == 6


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


def test_torchrun_gets_its_signals_through_both_variables_and_a_bad_grace_is_refused(capsys):
    from launchers import recovery
    from pipeline.runs.launch import torchrun_env

    default = torchrun_env(150, {})
    assert "SIGUSR1" in default["PET_SIGNALS_TO_HANDLE"].split(",") and "SIGUSR2" in default["PET_SIGNALS_TO_HANDLE"]
    assert default["TORCHELASTIC_SIGNALS_TO_HANDLE"] == default["PET_SIGNALS_TO_HANDLE"]
    assert default["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "150"
    # a list the user exported under either name reaches both readers
    for name in ("PET_SIGNALS_TO_HANDLE", "TORCHELASTIC_SIGNALS_TO_HANDLE"):
        mine = torchrun_env(5, {name: "SIGTERM,SIGUSR1"})
        assert mine["PET_SIGNALS_TO_HANDLE"] == mine["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGUSR1", name
    assert recovery.main(["--torchrun-env", "soon"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "PRISM_SHUTDOWN_GRACE='soon'" in err
