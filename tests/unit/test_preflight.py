"""The per-node pre-flight (pipeline/preflight.py) and the exclusion of a node that fails it (launchers/nodes.py):
thresholds against small fake requirements, the lines, the exit codes and the ExcNodeList bookkeeping. The real
run on Slurm is tests/integration/test_preflight_slurm.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from launchers import nodes
from pipeline import config, preflight
from pipeline.budget import checkpoint_bytes
from pipeline.exit_codes import EXIT_BAD_INPUT, EXIT_PREFLIGHT

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/tiny_prism.yaml")


def test_disk_passes_a_requirement_that_fits_and_fails_one_that_does_not(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    assert preflight.check_disk(tmp_path, 1e6).ok
    short = preflight.check_disk(tmp_path, free + 1e12)
    assert short.ok is False and "free" in short.detail and f"{(free + 1e12) / 1e9:.2f} GB" in short.detail


def test_memory_reads_mem_available_against_the_staging(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8000 kB\nMemFree:        1000 kB\nMemAvailable:   3000 kB\n")
    assert preflight.available_memory(meminfo) == 3000 * 1024
    assert preflight.check_memory(3000 * 1024, meminfo).ok
    assert preflight.check_memory(3000 * 1024 + 1, meminfo).ok is False
    meminfo.write_text("MemTotal:       8000 kB\n")
    assert preflight.check_memory(1, meminfo).ok is None  # unreadable: said, not failed


def test_writable_leaves_nothing_behind_and_fails_where_nothing_can_be_written(tmp_path):
    ok = preflight.check_writable(tmp_path)
    assert ok.ok and list(tmp_path.iterdir()) == []
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    bad = preflight.check_writable(not_a_folder)
    assert bad.ok is False and str(not_a_folder) in bad.detail
    assert preflight.existing(tmp_path / "a" / "b") == tmp_path  # a first start: its parent is checked


def test_requirements_are_one_checkpoint_on_disk_and_each_ranks_shard_in_memory(tmp_path):
    cfg = config.load(TINY, [f"run.output_dir={tmp_path}"])
    disk, one = preflight.requirements(cfg, nodes=1, nproc_per_node=1)
    assert disk == checkpoint_bytes(cfg)["total"]
    assert one == pytest.approx(disk)  # one rank holds the whole checkpoint
    _, four = preflight.requirements(cfg, nodes=1, nproc_per_node=4)  # DP 4: each rank a quarter of the optimizer
    assert one < four < 4 * one
    sync = config.load(TINY, [f"run.output_dir={tmp_path}", "checkpoint.async_save=false"])
    assert preflight.requirements(sync, 1, 4)[1] == 0  # nothing staged in host memory


def test_the_gpu_checks_run_on_cuda_and_say_they_were_skipped_on_cpu():
    checks = {c.name: c for c in preflight.gpu_checks(min_gbps=0.0)}
    assert list(checks) == ["gemm", "allreduce"]
    if not Path(preflight.NVIDIA_DEVICE).exists():  # told without importing torch
        assert all(c.ok is None and "CPU" in c.detail for c in checks.values())
        return
    import torch

    assert checks["gemm"].ok is (True if torch.cuda.is_available() else None), checks["gemm"]
    two = torch.cuda.device_count() > 1
    assert checks["allreduce"].ok is (True if two else None), checks["allreduce"]


def test_main_prints_a_line_per_check_and_an_injected_failure_names_the_node(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLURMD_NODENAME", "prism2")
    argv = [TINY, f"run.output_dir={tmp_path}", "--nodes", "1", "--nproc-per-node", "1"]
    monkeypatch.setenv("PRISM_FAULT_PREFLIGHT", "prism1")
    assert preflight.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert [x.split(":")[1].split()[1] for x in out] == ["writable", "disk", "memory", "gemm", "allreduce"]
    monkeypatch.setenv("PRISM_FAULT_PREFLIGHT", "prism1,prism2")
    assert preflight.main(argv) == EXIT_PREFLIGHT
    out = capsys.readouterr().out.splitlines()
    assert "preflight prism2: FAILED injected" in out[-2]
    assert nodes.failed_nodes("\n".join(out)) == ["prism2"]


@pytest.mark.parametrize(
    "flags",
    [
        ["--nodes", "0", "--nproc-per-node", "1"],
        ["--nodes", "1", "--nproc-per-node", "x"],
        ["--nodes", "1", "--nproc-per-node", "1", "--min-allreduce-gbps", "-5"],
        ["--nodes", "1", "--nproc-per-node", "1", "--min-allreduce-gbps", "nan"],
        ["--nodes", "1", "--nproc-per-node", "1", "--bogus"],
        ["--nodes", "1", "--nproc-per-node", "1", "train.lr=-1"],
    ],
)
def test_bad_flags_are_one_line_and_exit_2(flags, tmp_path, capsys):
    assert preflight.main([TINY, f"run.output_dir={tmp_path}", *flags]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and "Traceback" not in err, err


def test_bad_job_settings_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    argv = ["preflight", str(tmp_path), "1", "1", TINY, f"run.output_dir={tmp_path}"]
    monkeypatch.setenv("PRISM_PREFLIGHT_MIN_ALLREDUCE_GBPS", "fast")
    assert nodes.main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "PRISM_PREFLIGHT_MIN_ALLREDUCE_GBPS" in err, err
    monkeypatch.delenv("PRISM_PREFLIGHT_MIN_ALLREDUCE_GBPS")
    monkeypatch.setenv("PRISM_MAX_RESTARTS", "-1")
    assert nodes.main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "PRISM_MAX_RESTARTS='-1'" in err, err


def test_failed_nodes_come_from_the_verdict_lines_and_from_srun():
    output = "\n".join(
        [
            "preflight prism1: ok writable: /runs",
            "preflight prism3: FAILED disk: 0.01 GB free",
            preflight.failed_line("prism3", [preflight.Check("disk", False, "")]),
            "srun: error: prism3: task 2: Exited with exit code 6",
            "srun: error: prism4: task 3: Killed",  # its check could not finish: srun names it
        ]
    )
    assert nodes.failed_nodes(output) == ["prism3", "prism4"]
    assert nodes.failed_nodes("preflight prism1: ok disk: fine\n") == []


def test_the_exclusion_list_merges_with_what_the_job_has():
    assert nodes.merge([], ["prism2"]) == ["prism2"]
    assert nodes.merge(["prism1", "prism5"], ["prism5", "prism2"]) == ["prism1", "prism5", "prism2"]
    show = "JobId=12 JobName=prism-757m ReqNodeList=(null) ExcNodeList=(null) NodeList=prism2"
    assert nodes.job_field(show, "ExcNodeList") == "" and nodes.job_field(show, "NodeList") == "prism2"
    assert nodes.job_field(show.replace("ExcNodeList=(null)", "ExcNodeList=prism[1-2]"), "ExcNodeList") == "prism[1-2]"
