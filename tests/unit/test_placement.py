"""Backend and GPU of a worker (issue 12 item 3): NCCL on CUDA even for one process, gloo for train.device=cpu,
the GPU from LOCAL_RANK among the GPUs the worker sees. `placement` is pure; init_distributed is checked with
torch's CUDA queries and init_process_group patched, so the CPU-only host plays a GPU host."""

from __future__ import annotations

import pytest

from pipeline.distributed import DeviceError, Placement, placement


@pytest.mark.parametrize(
    ("device", "env", "gpus", "want"),
    [
        ("cuda", {}, 1, Placement("nccl", "cuda:0")),  # one process, no RANK: NCCL all the same
        ("cuda", {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "5"}, 8, Placement("nccl", "cuda:5")),  # torchrun
        ("cuda", {"RANK": "3", "LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "3"}, 1, Placement("nccl", "cuda:0")),
        ("cpu", {"LOCAL_RANK": "3"}, 8, Placement("gloo", "cpu")),  # train.device=cpu on a GPU host
        ("cpu", {}, 0, Placement("gloo", "cpu")),  # the CPU-only path stays gloo
    ],
)
def test_placement_rule(device, env, gpus, want):
    assert placement(device, env, gpus) == want


def test_placement_refuses_two_workers_on_one_gpu():
    with pytest.raises(DeviceError, match=r"LOCAL_RANK=5 but this worker sees 4 GPUs \(CUDA_VISIBLE_DEVICES=0,1,2,3\)"):
        placement("cuda", {"LOCAL_RANK": "5", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4)


@pytest.fixture
def fake_gpu_host(monkeypatch):
    """torch says 2 GPUs exist; init_process_group and set_device record instead of acting."""
    import torch
    import torch.distributed as dist

    from pipeline import compat

    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", str(d)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.setdefault("backend", backend))
    monkeypatch.setattr(compat.megatron, "_CPU_DEVICE_CHOSEN", False)  # the CPU-shim state lives there
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    return calls


def test_single_process_on_a_gpu_host_initialises_nccl(fake_gpu_host):
    from pipeline import distributed

    distributed.init_distributed("auto")
    assert fake_gpu_host == {"set_device": "cuda:0", "backend": "nccl"}


def test_train_device_cpu_on_a_gpu_host_uses_gloo_and_the_cpu_paths(fake_gpu_host, monkeypatch):
    from pipeline import compat, distributed

    monkeypatch.setenv("LOCAL_RANK", "1")
    distributed.init_distributed("cpu")
    assert fake_gpu_host == {"backend": "gloo"}  # no GPU selected
    assert not compat.cuda_available()  # megatron's CPU shims and DeepSpeed's CPU accelerator apply
    assert distributed.deepspeed_device_args() is None
