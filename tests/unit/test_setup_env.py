"""ops/setup_env.sh's install order, run for real against a stand-in venv: its python (no site-packages)
imports a fake torch (CPU, CUDA or none) and its `python -m pip` only records the command line, so nothing
is installed."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The deepspeed requirement as a TOML parser reads it; setup_env.sh takes it from pyproject.toml with sed.
DEEPSPEED_REQ = next(
    r
    for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    if r.startswith("deepspeed")
)

FAKE_TORCH = {
    "cuda": '__version__ = "2.9.0+cu128"\nclass version:\n    cuda = "12.8"\nclass cuda:\n    is_available = staticmethod(lambda: False)\n',
    "cpu": '__version__ = "2.13.0+cpu"\nclass version:\n    cuda = None\nclass cuda:\n    is_available = staticmethod(lambda: False)\n',
}


def stand_in_venv(tmp_path: Path, torch: str | None) -> tuple[Path, Path]:
    venv, site, log = tmp_path / "venv", tmp_path / "site", tmp_path / "pip.log"
    (venv / "bin").mkdir(parents=True)
    for module in ("megatron/core", "deepspeed"):
        (site / module).mkdir(parents=True)
        (site / module / "__init__.py").write_text('__version__ = "0.0"\n')
    if torch:
        (site / "torch").mkdir()
        (site / "torch" / "__init__.py").write_text(FAKE_TORCH[torch])
    python = venv / "bin" / "python"
    python.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = -m ] && [ "$2" = pip ]; then shift 2; echo "$*" >> {log}; exit 0; fi\n'
        f'PYTHONPATH={site} exec {sys.executable} -S "$@"\n'
    )
    python.chmod(0o755)
    return venv, log


def setup_env(venv: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "ops" / "setup_env.sh")],
        env={**os.environ, "VENV": str(venv), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("torch", ["cuda", "cpu"])
def test_an_existing_torch_is_kept_and_deepspeed_built_against_it(tmp_path, torch):
    venv, log = stand_in_venv(tmp_path, torch)
    out = setup_env(venv)
    assert out.returncode == 0, out.stderr
    pip = log.read_text().splitlines()
    assert not any(arg.startswith("torch") for line in pip for arg in line.split()), pip
    deepspeed = [line for line in pip if "deepspeed" in line]
    assert deepspeed == [f"install -q --no-build-isolation {DEEPSPEED_REQ}"], pip
    # DeepSpeed is built before the project, so the project install finds it satisfied and builds nothing
    assert pip.index(deepspeed[0]) < pip.index("install -q -e .[dev]")


def test_without_torch_the_cpu_wheel_goes_in_before_deepspeed(tmp_path):
    venv, log = stand_in_venv(tmp_path, None)
    out = setup_env(venv, TORCH_CPU_VERSION="2.13.0")
    assert out.returncode == 0, out.stderr
    pip = log.read_text().splitlines()
    assert pip.index("install -q torch==2.13.0") < pip.index(f"install -q --no-build-isolation {DEEPSPEED_REQ}")


def test_dry_run_prints_the_commands_and_creates_nothing(tmp_path):
    venv = tmp_path / "new-venv"
    out = setup_env(venv, DRY_RUN="1", PYTHON="python3")
    assert out.returncode == 0, out.stderr
    assert not venv.exists()
    lines = out.stdout.splitlines()
    assert f"dry-run: python3 -m venv {venv}" in lines
    assert f"dry-run: pip install --no-build-isolation {DEEPSPEED_REQ}" in lines


def test_the_gpu_extra_goes_in_only_where_the_nvidia_driver_is(tmp_path):
    venv, log = stand_in_venv(tmp_path, "cuda")
    bin_dir = tmp_path / "driver-bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    plain_path = os.environ["PATH"]
    assert setup_env(venv, PATH=plain_path).returncode == 0
    assert setup_env(venv, PATH=f"{bin_dir}:{plain_path}").returncode == 0
    installs = [line for line in log.read_text().splitlines() if line.startswith("install -q -e ")]
    assert installs == ["install -q -e .[dev]", "install -q -e .[dev,gpu]"], installs
