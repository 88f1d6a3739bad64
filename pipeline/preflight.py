"""Per-node pre-flight: is this node fit to start a training step? launchers/train_job.sh runs it on every
node of the job (one srun task per node) before each start of the step; launchers.nodes excludes a node that
fails and requeues the job.

    python -m pipeline.preflight CONFIG [overrides...] --nodes N --nproc-per-node P [--min-allreduce-gbps X]

The checks, one line each (`preflight NODE: ok|FAILED|skipped CHECK: detail`):
- writable: a probe file in the checkpoint folder is written, fsynced, read back and removed;
- disk: the checkpoint folder's filesystem has room for one more checkpoint (pipeline.budget.checkpoint_bytes;
  a save lands before the one it replaces is pruned);
- memory: MemAvailable covers the host copies of this node's ranks' checkpoint shards (the non-blocking save
  stages them there, pipeline.checkpoint.writer);
- gemm (CUDA): a matmul on every visible GPU is finite and matches a float64 reference (a GPU that computes
  garbage, or NaN, without crashing);
- allreduce (CUDA, 2+ GPUs): the bus bandwidth of an all-reduce over the node's GPUs is above the floor (a lost
  NVLink falls back to PCIe at a tenth of it).
On a node without CUDA the GPU checks say they were skipped. Exits 0 when every check passed, EXIT_PREFLIGHT
when one failed (the last line names the node), EXIT_BAD_INPUT on a bad flag or config. torch is imported only
for the GPU checks, so the CPU checks take well under a second.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline import faults
from pipeline.config import Config, ConfigError
from pipeline.exit_codes import EXIT_BAD_INPUT, EXIT_PREFLIGHT

GEMM_SIZE = 1024  # big enough to use the tensor cores, small enough to check in float64 on the CPU in ~0.1 s
GEMM_TOLERANCE = 1e-2  # relative Frobenius error: TF32/bf16 rounding is ~1e-3, a broken unit is O(1)
ALLREDUCE_BYTES = 64 * 2**20  # large enough to reach the link's bandwidth, not its latency
# Default floor on the all-reduce bus bandwidth (GB/s): an 8-GPU NVLink node measures several hundred at
# 64 MiB, a node whose NVLink fell back to PCIe a few tens. PCIe-only nodes need a lower floor (the flag).
MIN_ALLREDUCE_GBPS = 100.0
NVIDIA_DEVICE = "/dev/nvidiactl"  # the NVIDIA driver's control device, present wherever a GPU is usable


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool | None  # None: skipped (and the detail says why)
    detail: str


def node_name() -> str:
    """The node as Slurm names it (SLURMD_NODENAME in a step: several slurmd can share one host), else the host."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def line(node: str, check: Check) -> str:
    state = "skipped" if check.ok is None else ("ok" if check.ok else "FAILED")
    return f"preflight {node}: {state} {check.name}: {check.detail}"


# The verdict line of a failed node; launchers.nodes reads the node's name back from the step's output.
FAILED_NODE = re.compile(r"^preflight (\S+): node failed its pre-flight")


def failed_line(node: str, failed: list[Check]) -> str:
    return f"preflight {node}: node failed its pre-flight ({', '.join(c.name for c in failed)})"


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def existing(folder: Path) -> Path:
    """``folder`` or its nearest existing parent (a first start has no checkpoint folder yet; the check
    creates nothing)."""
    folder = folder.absolute()
    return next(p for p in (folder, *folder.parents) if p.is_dir())


def check_writable(folder: Path) -> Check:
    probe = folder / f".preflight-{node_name()}-{os.getpid()}"
    payload = os.urandom(4096)
    try:
        with open(probe, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        same = probe.read_bytes() == payload
    except OSError as e:
        return Check("writable", False, f"{folder}: {e.strerror or e}")
    finally:
        with contextlib.suppress(OSError):  # nothing was created where nothing can be written
            probe.unlink(missing_ok=True)
    if not same:
        return Check("writable", False, f"{folder}: a probe file read back different bytes")
    return Check("writable", True, f"{folder} (probe written, fsynced, read back, removed)")


def check_disk(folder: Path, need_bytes: float) -> Check:
    free = shutil.disk_usage(folder).free
    detail = f"{gb(free)} free on {folder}'s filesystem, one checkpoint needs {gb(need_bytes)}"
    return Check("disk", free >= need_bytes, detail)


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable in bytes: what the kernel can hand out without swapping (page cache included)."""
    for row in meminfo.read_text().splitlines():
        if row.startswith("MemAvailable:"):
            return int(row.split()[1]) * 1024
    raise OSError(f"{meminfo} has no MemAvailable line")


def check_memory(need_bytes: float, meminfo: Path = Path("/proc/meminfo")) -> Check:
    try:
        free = available_memory(meminfo)
    except OSError as e:
        return Check("memory", None, f"cannot read the available memory ({e})")
    detail = f"{gb(free)} available, the checkpoint staging of this node's ranks needs {gb(need_bytes)}"
    return Check("memory", free >= need_bytes, detail)


def requirements(cfg: Config, nodes: int, nproc_per_node: int) -> tuple[float, float]:
    """(disk bytes, host memory bytes) a node needs: one whole checkpoint on the checkpoint filesystem, and
    with non-blocking saves the host copy of each of its ranks' shards (the largest rank's, to be safe)."""
    from pipeline.budget import checkpoint_bytes  # the one owner of what a checkpoint holds
    from pipeline.checkpoint.plan import checkpoint_plan

    tp = cfg.parallel.tp
    dp = max(1, nodes * nproc_per_node // tp)
    staging = checkpoint_plan(cfg, nodes, tp, dp).bytes_largest_rank * nproc_per_node
    return checkpoint_bytes(cfg)["total"], staging if cfg.checkpoint.async_save else 0.0


def check_gemm(torch) -> Check:
    """A seeded matmul on every visible GPU against one float64 product on the CPU."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(GEMM_SIZE, GEMM_SIZE, generator=gen)
    b = torch.randn(GEMM_SIZE, GEMM_SIZE, generator=gen)
    want = a.double() @ b.double()
    bad = []
    for dev in range(torch.cuda.device_count()):
        got = (a.to(f"cuda:{dev}") @ b.to(f"cuda:{dev}")).double().cpu()
        if not torch.isfinite(got).all():
            bad.append(f"cuda:{dev} NaN/inf")
        elif (err := float(torch.linalg.norm(got - want) / torch.linalg.norm(want))) > GEMM_TOLERANCE:
            bad.append(f"cuda:{dev} error {err:.1e}")
    count = torch.cuda.device_count()
    if bad:
        return Check("gemm", False, f"{', '.join(bad)} (tolerance {GEMM_TOLERANCE:g})")
    return Check("gemm", True, f"{GEMM_SIZE}x{GEMM_SIZE} matmul on {count} GPU(s) finite, within {GEMM_TOLERANCE:g}")


def check_allreduce(torch, min_gbps: float) -> Check:
    """NCCL all-reduce over this node's GPUs from one process (torch.cuda.nccl), as nccl-tests reports it:
    bus bandwidth = bytes x 2(n-1)/n / time."""
    import torch.cuda.nccl as nccl

    n = torch.cuda.device_count()
    if n < 2:
        return Check("allreduce", None, f"{n} GPU on this node: no all-reduce inside it to measure")
    tensors = [torch.ones(ALLREDUCE_BYTES // 4, device=f"cuda:{d}") for d in range(n)]
    nccl.all_reduce(tensors)  # warm-up: NCCL builds its communicator here
    for d in range(n):
        torch.cuda.synchronize(d)
    if not all(bool((t == n).all()) for t in tensors):
        return Check("allreduce", False, f"{n} GPUs: a sum of ones is not {n} everywhere")
    repeats = 5
    start = time.perf_counter()
    for _ in range(repeats):
        nccl.all_reduce(tensors)
    for d in range(n):
        torch.cuda.synchronize(d)
    seconds = (time.perf_counter() - start) / repeats
    busbw = ALLREDUCE_BYTES * 2 * (n - 1) / n / seconds / 1e9
    detail = f"{busbw:.1f} GB/s bus bandwidth over {n} GPUs ({ALLREDUCE_BYTES // 2**20} MiB), floor {min_gbps:g} GB/s"
    return Check("allreduce", busbw >= min_gbps, detail)


def gpu_checks(min_gbps: float, nproc_per_node: int = 1) -> list[Check]:
    # No NVIDIA driver device: a CPU node, told without the seconds an import of torch takes.
    if Path(NVIDIA_DEVICE).exists():
        import torch

        if torch.cuda.is_available():
            if (count := torch.cuda.device_count()) < nproc_per_node:  # a GPU fell off the bus
                lost = f"{count} GPU(s) visible for {nproc_per_node} training processes on this node"
                return [Check("gemm", False, lost), Check("allreduce", None, lost)]
            try:
                return [check_gemm(torch), check_allreduce(torch, min_gbps)]
            except RuntimeError as e:  # a CUDA or NCCL error: the GPU, not the input
                return [Check("gemm", False, f"CUDA error: {str(e).splitlines()[0]}")]
    why = "no CUDA device on this node (CPU run)"
    return [Check("gemm", None, why), Check("allreduce", None, why)]


def run_checks(cfg: Config, nodes: int, nproc_per_node: int, min_gbps: float) -> list[Check]:
    disk, memory = requirements(cfg, nodes, nproc_per_node)
    folder = existing(Path(cfg.checkpoint_dir))
    checks = [
        check_writable(folder),
        check_disk(folder, disk),
        check_memory(memory),
        *gpu_checks(min_gbps, nproc_per_node),
    ]
    if faults.preflight_fails(node_name()):
        checks.append(Check("injected", False, "PRISM_FAULT_PREFLIGHT names this node"))
    return checks


class OneLineParser(argparse.ArgumentParser):
    """Bad flags in one line and exit 2, like every other bad input."""

    def error(self, message: str):
        raise ConfigError(f"{message}; usage: {' '.join(self.format_usage().split()[1:])}")


def parse(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(prog="python -m pipeline.preflight", description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--nodes", type=int, required=True, help="nodes of the job")
    p.add_argument("--nproc-per-node", type=int, required=True, help="training processes per node")
    p.add_argument("--min-allreduce-gbps", type=float, default=MIN_ALLREDUCE_GBPS, help="all-reduce floor, GB/s")
    args, extra = p.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray:
        p.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides += extra
    if args.nodes < 1 or args.nproc_per_node < 1:
        p.error(f"--nodes {args.nodes} and --nproc-per-node {args.nproc_per_node} must both be >= 1")
    if not args.min_allreduce_gbps >= 0 or args.min_allreduce_gbps == float("inf"):
        p.error(f"--min-allreduce-gbps {args.min_allreduce_gbps} is not a bandwidth >= 0 in GB/s (e.g. 100)")
    return args


def main(argv: list[str]) -> int:
    from pipeline import config

    try:
        args = parse(argv)
        cfg = config.load(args.config, args.overrides)
    except ConfigError as e:
        print(f"preflight {node_name()}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    node = node_name()
    checks = run_checks(cfg, args.nodes, args.nproc_per_node, args.min_allreduce_gbps)
    for check in checks:
        print(line(node, check), flush=True)
    failed = [c for c in checks if c.ok is False]
    if failed:
        print(failed_line(node, failed), flush=True)
        return EXIT_PREFLIGHT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
