"""Process plumbing the trainer, the model and the readers share: process groups, the device, collectives.

Library quirks (megatron-core or DeepSpeed assuming CUDA, version differences) are not here but in
pipeline.compat; this module only says how processes join, which device they use and how ranks exchange
values.
"""

from __future__ import annotations

import datetime
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.config import Config, ConfigError
from pipeline.signals import stop_signal_numbers


class DeviceError(ConfigError):
    """The requested device is not there (one line: what was asked and what to use instead)."""


def resolve_device(requested: str = "auto") -> str:
    """'cuda' or 'cpu' for a requested 'auto' | 'cpu' | 'cuda' (auto: CUDA when a GPU is visible)."""
    import torch

    if requested not in ("auto", "cpu", "cuda"):
        raise DeviceError(f"device {requested!r} is not one of auto, cpu, cuda")
    if requested == "cuda" and not torch.cuda.is_available():
        raise DeviceError("device cuda was asked for but no CUDA device is visible; use cpu or auto")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def train_device(cfg: Config) -> str:
    """The device ``train.device`` resolves to on this host; an impossible ask names the config key."""
    try:
        return resolve_device(cfg.train.device)
    except DeviceError as e:
        raise ConfigError(f"{cfg.source}: train.device: {e}") from None


def setup_threads() -> None:
    """Several ranks on one CPU host must not each spawn a thread per core."""
    if "LOCAL_WORLD_SIZE" in os.environ and "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(max(1, node_cpus() // int(os.environ["LOCAL_WORLD_SIZE"])))


def node_cpus() -> int:
    """CPUs this process may use: its affinity, capped by the Slurm step's CPUs per task where there is one."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    return min(cpus, int(slurm)) if slurm.isdigit() and int(slurm) > 0 else cpus


def local_run_env(concurrent: int, threads: int | None = None) -> dict[str, str]:
    """The environment of a `prism train` started on this host beside ``concurrent - 1`` others (the demo,
    the study, local search trials): output unbuffered, and the cores shared out, each run taking
    ``threads`` or, when not given, its share of node_cpus() (a user's OMP_NUM_THREADS wins then). A run alone
    shares nothing and keeps the libraries' own thread counts."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads is None and ("OMP_NUM_THREADS" in env or concurrent <= 1):
        return env
    count = str(threads if threads is not None else max(1, node_cpus() // max(1, concurrent)))
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = count
    return env


# --- process groups -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """Where one worker runs: its collective backend and its device ("cpu" or "cuda:N", N a visible index)."""

    backend: str
    device: str


def placement(device: str, env: Mapping[str, str], visible_gpus: int) -> Placement:
    """NCCL on CUDA (one process too), gloo on CPU; the GPU is the worker's LOCAL_RANK among the GPUs it sees.

    ``device`` is the resolved train device ('cuda' | 'cpu'). Rule for what a worker sees:
    - LOCAL_RANK < visible GPUs: the node's GPUs are all visible (torchrun, one task per node) -> cuda:LOCAL_RANK;
    - exactly one visible GPU: the scheduler bound one GPU to this task (Slurm's per-task
      CUDA_VISIBLE_DEVICES, where LOCAL_RANK can be 3 and the GPU is index 0) -> cuda:0;
    - otherwise (LOCAL_RANK 5 with 4 GPUs visible) two workers would share a GPU: refused."""
    if device == "cpu":
        return Placement("gloo", "cpu")
    local_rank = int(env.get("LOCAL_RANK", 0))
    if visible_gpus < 1:
        raise DeviceError("device cuda was asked for but no CUDA device is visible; use cpu or auto")
    if local_rank < visible_gpus:
        return Placement("nccl", f"cuda:{local_rank}")
    if visible_gpus == 1:
        return Placement("nccl", "cuda:0")
    raise DeviceError(
        f"LOCAL_RANK={local_rank} but this worker sees {visible_gpus} GPUs (CUDA_VISIBLE_DEVICES="
        f"{env.get('CUDA_VISIBLE_DEVICES', 'unset')}); give each worker all of the node's GPUs or exactly one"
    )


def init_distributed(device: str = "auto", timeout_s: float = 1800) -> None:
    """torch.distributed from torchrun's env, else a world of 1; backend and GPU from ``placement``.

    ``device`` is train.device ('auto' | 'cpu' | 'cuda'): 'cpu' on a GPU host means gloo and CPU tensors.
    ``timeout_s``: how long a collective waits (the trainer passes parallel.init_timeout_s; HangWatch lowers it)."""
    import torch
    import torch.distributed as dist

    from pipeline import compat

    if dist.is_initialized():
        return
    where = placement(resolve_device(device), os.environ, torch.cuda.device_count())
    if where.device == "cpu":
        compat.use_cpu_device()  # megatron's CPU shims and DeepSpeed's CPU accelerator, even with a GPU present
    else:
        torch.cuda.set_device(torch.device(where.device))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        die_with_launcher()
        dist.init_process_group(where.backend, timeout=datetime.timedelta(seconds=timeout_s))
    else:  # one process: an in-process store, no MASTER_ADDR needed
        dist.init_process_group(where.backend, store=dist.HashStore(), rank=0, world_size=1)


def die_with_launcher() -> None:
    """Under torchrun: the kernel SIGKILLs this worker when its agent dies (Linux PR_SET_PDEATHSIG).

    torchrun kills its workers after their grace, but Slurm can signal a step's processes twice, and the
    second signal may kill torchrun inside that grace. Without this, a hung rank that ignores SIGTERM would
    outlive it as an orphan holding its GPU and the step's output, which proctrack/linuxproc's KillWait does
    not reach."""
    import sys

    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    agent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != agent:  # the agent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


def deepspeed_device_args() -> Any:
    """``args`` for deepspeed.initialize naming this worker's GPU: DeepSpeed otherwise takes LOCAL_RANK as
    the device index, which is wrong when the scheduler binds one GPU per task. None on CPU."""
    import types

    from pipeline import compat

    if not compat.cuda_available():
        return None
    import torch

    return types.SimpleNamespace(device_rank=torch.cuda.current_device())


def init_model_parallel(tp: int, seed: int, device: str = "auto") -> None:
    """torch.distributed (if needed), megatron's parallel_state with TP=tp, and the model-parallel RNG.

    Calling it again with another TP size tears the old groups down first (tests switch TP 1 -> 2)."""
    import torch
    from megatron.core import parallel_state, tensor_parallel

    from pipeline import compat

    init_distributed(device)
    world = torch.distributed.get_world_size()
    if world % tp:
        raise ConfigError(f"parallel.tp={tp} does not divide the world size {world}; use a divisor of {world}")
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() != tp:
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)  # CPU-initialised master weights draw from the default generator
    if compat.cuda_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        compat.megatron_on_cpu(seed)


# --- collectives ----------------------------------------------------------------------------------------
def tp_all_gather(tensor: Any, dim: int) -> Any:
    """Concatenate every tensor-parallel rank's ``tensor`` along ``dim`` (rank order); no gradient.

    megatron's gather helper allocates its output on the CUDA device; a plain all_gather works on both."""
    import torch
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(tp)]
    torch.distributed.all_gather(parts, tensor, group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


def dp_sum(tensor: Any) -> Any:
    """Sum ``tensor`` in place over the data-parallel group; returns it."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.all_reduce(tensor, group=parallel_state.get_data_parallel_group())
    return tensor


class StopSignal:
    """A stop signal (pipeline/signals.py) sets a flag; ranks agree at each step boundary (all-reduce MAX) to stop
    together."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.end_reached = False  # the job's end time is near (pipeline.slurm_job.JobEnd): stop as for a signal
        for sig in stop_signal_numbers():
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signum

    def agreed(self, device: str, group: Any = None, news: float = 0.0) -> tuple[bool, float]:
        """(stop, news): stop is True on every rank when any rank received a signal; news is the largest
        ``news`` any rank passed (a profile request, pipeline.profiling), carried by the same all-reduce so it
        costs no collective of its own. A collective: every rank calls it."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.received or self.end_reached else 0.0, news], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        stop, value = flag.tolist()
        return bool(stop), value

    def restore(self) -> None:
        for sig in stop_signal_numbers():
            signal.signal(sig, signal.SIG_DFL)


# --- hangs: short collective timeouts after the first step, every rank's stack before the job dies -------
def diagnostics_dir(cfg: Config) -> Any:
    """Where a run keeps what explains a hang or crash: per-rank Python stacks, NCCL flight records."""
    return cfg.checkpoint_dir / "diagnostics"


class HangWatch:
    """Per rank: faulthandler writes this rank's Python stacks (all threads) to ``folder/stacks-rankR.txt``
    when a step runs past 90 % of the collective timeout (a timer re-armed at every step, so the ranks still
    alive write theirs before the timed-out collective ends the job) and on a fatal signal (NCCL's abort on a
    timeout: SIGABRT). After the first step of this start every group's timeout drops from
    parallel.init_timeout_s to parallel.timeout_s."""

    def __init__(self, folder: Any, rank: int, init_timeout_s: float, timeout_s: float, step: int) -> None:
        import faulthandler
        import time

        from pipeline import compat

        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"stacks-rank{rank}.txt"
        self.file = open(self.path, "a")  # noqa: SIM115 - faulthandler writes to its fd until close()
        self.file.write(f"=== start at step {step}, pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        self.file.flush()
        self.was_enabled = faulthandler.is_enabled()
        faulthandler.enable(file=self.file, all_threads=True)
        self.timeout_s, self.after_first_s = init_timeout_s, timeout_s
        compat.set_collective_timeout(init_timeout_s)  # megatron's groups were made with their own 30 min
        self.arm()

    def arm(self) -> None:
        import faulthandler

        faulthandler.dump_traceback_later(0.9 * self.timeout_s, repeat=False, file=self.file, exit=False)

    def step_done(self) -> None:
        """After every step: the first lowers the timeouts; each re-arms the stack timer."""
        if self.timeout_s != self.after_first_s:
            from pipeline import compat

            compat.set_collective_timeout(self.after_first_s)
            self.timeout_s = self.after_first_s
        self.arm()

    def close(self) -> None:
        import faulthandler
        import sys

        faulthandler.cancel_dump_traceback_later()
        faulthandler.disable()
        if self.was_enabled:  # e.g. pytest's, to stderr
            faulthandler.enable(file=sys.stderr)
        self.file.close()


# --- where the ranks run, and how training ended (read by launchers/train_job.sh) ------------------------
def node_name() -> str:
    """This process's node: Slurm's node name (several can share a host), else the hostname."""
    import socket

    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def topology() -> list[dict[str, Any]]:
    """Every rank's node (node_name), local rank and CPUs, gathered in rank order."""
    import torch.distributed as dist

    mine = {
        "rank": dist.get_rank(),
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        "node": node_name(),
        "cpus": node_cpus(),
        "slurm_cpus_per_task": os.environ.get("SLURM_CPUS_PER_TASK", ""),
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def topology_line(ranks: list[dict[str, Any]]) -> str:
    """`topology: 2 node(s): prism1 ranks 0,1 (SLURM_CPUS_PER_TASK 4), prism2 ranks 2,3 (...)`."""
    nodes: dict[str, list[dict[str, Any]]] = {}
    for r in ranks:
        nodes.setdefault(r["node"], []).append(r)
    parts = [
        f"{node} ranks {','.join(str(r['rank']) for r in rs)} "
        f"(SLURM_CPUS_PER_TASK {rs[0]['slurm_cpus_per_task'] or '-'}, {rs[0]['cpus']} CPUs)"
        for node, rs in nodes.items()
    ]
    return f"topology: {len(nodes)} node(s): {', '.join(parts)}"
