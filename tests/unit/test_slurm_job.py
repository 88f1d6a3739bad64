"""What a job reads of Slurm (pipeline.slurm_job): its end time decides the final checkpoint from the measured
save and step times plus the margin; the requeue warning comes one requeue before the limit; a bad
PRISM_MAX_BATCH_REQUEUE is one line. Environments are passed in; no Slurm is asked."""

from __future__ import annotations

import time

import pytest

from pipeline import slurm_job
from pipeline.config import ConfigError


def test_no_end_time_outside_a_job_without_a_limit_or_without_a_launcher_that_requeues():
    requeues = {"PRISM_REQUEUES_A_STOP": "1"}  # train_job.sh requeues a stop
    assert slurm_job.JobEnd.of_this_job(60, requeues) is None
    assert slurm_job.JobEnd.of_this_job(60, {**requeues, "SLURM_JOB_END_TIME": "0"}) is None  # no time limit
    assert slurm_job.JobEnd.of_this_job(60, {**requeues, "SLURM_JOB_END_TIME": "1781000000"}).end == 1781000000
    assert slurm_job.JobEnd.of_this_job(60, {"SLURM_JOB_END_TIME": "1781000000"}) is None  # a submitit job
    with_record = {"SLURM_JOB_END_TIME": "1781000000", "PRISM_EXIT_FILE": "/tmp/exit"}  # it has an exit record too
    assert slurm_job.JobEnd.of_this_job(60, with_record) is None
    assert slurm_job.JobEnd.of_this_job(60, {**with_record, "PRISM_REQUEUES_A_STOP": "0"}) is None  # PRISM_REQUEUE=0


def test_the_final_checkpoint_comes_when_save_step_and_margin_no_longer_fit():
    now = time.time()
    end = slurm_job.JobEnd(now + 100, margin_s=30)
    assert end.due(None, now=now) is None  # first step: its time (warm-up) is not counted
    end.last -= 20  # the next step took 20 s
    assert end.due(40.0, now=now) is None  # 100 s left > 40 + 20 + 30
    assert end.longest_step >= 20
    why = end.due(55.0, now=now)  # 100 s left < 55 + 20 + 30
    assert why is not None and "SLURM_JOB_END_TIME" in why and "save 55.0 s" in why, why
    assert slurm_job.JobEnd(now + 10, margin_s=30).due(None, now=now) is not None  # margin alone


def test_the_requeue_warning_comes_one_requeue_before_the_limit():
    env = {slurm_job.MAX_BATCH_REQUEUE_ENV: "5"}
    assert slurm_job.requeue_warning({**env, "SLURM_RESTART_COUNT": "3"}) is None
    warning = slurm_job.requeue_warning({**env, "SLURM_RESTART_COUNT": "4"})
    assert warning is not None and "requeued 4 times" in warning and "PRISM_MAX_BATCH_REQUEUE" in warning, warning
    assert slurm_job.requeue_warning(env) is None  # not a requeued job


@pytest.mark.parametrize("value", ["-1", "five", "", "2.5"])
def test_a_bad_max_batch_requeue_is_one_line(value):
    with pytest.raises(ConfigError, match="PRISM_MAX_BATCH_REQUEUE") as bad:
        slurm_job.max_batch_requeue_override({slurm_job.MAX_BATCH_REQUEUE_ENV: value})
    assert "\n" not in str(bad.value)


def test_max_batch_requeue_is_read_from_either_spelling_of_scontrol_show_config():
    assert slurm_job.config_max_batch_requeue("JobRequeue              = 1\nMaxBatchRequeue         = 7\n") == 7
    line = "SchedulerParameters     = batch_sched_delay=0,max_batch_requeue=3,sched_min_interval=0"
    assert slurm_job.config_max_batch_requeue(f"KillWait = 30 sec\n{line}\n") == 3
    assert slurm_job.config_max_batch_requeue("SchedulerParameters     = batch_sched_delay=0\n") is None
