"""A tracking password never rides along with a job (issue 41 item 4): not in the environment sbatch copies
(and Slurm may store, AccountingStoreFlags=job_env), not in a job's overrides (submitit's pickle, `ps`)."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError
from pipeline.runs.launch import TrainJob, make_executor

PASSWORD = "s3cr3t-Pa55-41"


def test_a_slurm_submission_refuses_a_password_in_its_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    with pytest.raises(ConfigError, match=r"MLFLOW_TRACKING_PASSWORD is set: sbatch would copy it") as e:
        make_executor(tmp_path, "slurm")
    assert PASSWORD not in str(e.value) and "~/.mlflow/credentials" in str(e.value)
    assert make_executor(tmp_path, "local") is not None  # a local job's environment goes to no database


def test_a_job_refuses_an_override_holding_a_password():
    with pytest.raises(ConfigError, match=r"a password in a job's override") as e:
        TrainJob("configs/tiny_prism.yaml", ["run.seed=2", f"tracking.uri=http://bob:{PASSWORD}@mlflow:5000"])
    assert PASSWORD not in str(e.value) and "bob:***@" in str(e.value)
    assert TrainJob("configs/tiny_prism.yaml", ["tracking.uri=http://mlflow:5000"]).overrides
