"""pipeline.profiling's request file and train.profile_steps, and the SDPA kernel report
(pipeline.model.sdpa_backend): the kernel it names is the one that runs, a pinned kernel that cannot run a
layer's head dim is refused in one line, a GPU fallback is one warning line."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline import config, distributed, profiling
from pipeline.config import ConfigError
from pipeline.model import sdpa_backend
from pipeline.schedule import MAX_HEAD_DIM

TINY = "configs/tiny_prism.yaml"
# the aten op each SDPBackend runs as, in a profile
OPS = {
    "FLASH_ATTENTION": "flash_attention",
    "MATH": "_scaled_dot_product_attention_math",
    "EFFICIENT_ATTENTION": "efficient_attention",
    "CUDNN_ATTENTION": "cudnn_attention",
}


def load(*overrides):
    return config.load(TINY, ["model.seq_len=16", *overrides])


def test_a_request_round_trips_and_a_bad_one_is_set_aside(tmp_path, capsys):
    assert profiling.read_request(tmp_path) is None
    profiling.write_request(tmp_path, 3, memory=True)
    assert profiling.read_request(tmp_path) == (3, True)
    assert profiling.decode(profiling.encode(3, True)) == (3, True) and profiling.encode(0, False) == 0.0
    profiling.request_path(tmp_path).write_text(json.dumps({"steps": 0}))
    assert profiling.read_request(tmp_path) is None
    assert not profiling.request_path(tmp_path).exists()  # not read again at every sync step
    assert (tmp_path / "profile" / "request.rejected.json").exists()
    out = capsys.readouterr().out.strip()
    assert "is not a profile request" in out and "\n" not in out


@pytest.mark.parametrize("steps", ["[0,2]", "[3,2]", "[1,2,3]", "[5,100000]"])
def test_profile_steps_out_of_range_are_one_line(steps):
    with pytest.raises(ConfigError) as err:
        load(f"train.profile_steps={steps}")
    assert "train.profile_steps:" in str(err.value) and "\n" not in str(err.value)


def ops_run(cfg) -> set[str]:
    from pipeline.model import build_model

    distributed.init_model_parallel(1, cfg.run.seed)
    model = build_model(cfg)
    tokens = torch.zeros(1, 16, dtype=torch.long)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(tokens, None, None).float().sum().backward()
    return {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key or "attention" in e.key}


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_the_kernel_report_names_the_kernel_each_layer_runs(backend):
    cfg = load(f"model.attention_backend={backend}")
    kernels = sdpa_backend.layer_kernels(cfg, "cpu")
    assert len(kernels) == cfg.model.num_layers
    if backend == "math":
        assert set(kernels) == {"MATH"}
    ran = ops_run(cfg)
    assert all(any(OPS[k] in op for op in ran) for k in set(kernels)), (kernels, ran)
    others = set(OPS) - set(kernels)
    assert not any(OPS[k] in op for k in others for op in ran), ran
    line = sdpa_backend.kernel_line(cfg, kernels, "cpu")
    assert "\n" not in line and f"layers 1-2 d_h 64 {kernels[0]}" in line
    assert sdpa_backend.fallback_warning(cfg, kernels, "cpu") is None  # CPU has no fast GPU path to miss


def test_a_gpu_fallback_is_one_warning_line_naming_its_layers():
    cfg = load()
    kernels = ["EFFICIENT_ATTENTION"] * 2 + ["FLASH_ATTENTION"] * 6
    warning = sdpa_backend.fallback_warning(cfg, kernels, "cuda")
    assert "\n" not in warning and "layers 1-2 (d_h 64) EFFICIENT_ATTENTION" in warning and "layers 3" not in warning
    assert sdpa_backend.fallback_warning(cfg, ["FLASH_ATTENTION"] * 8, "cuda") is None
    params = sdpa_backend.kernel_params(cfg, kernels)
    assert params["attention/kernel_dh64"] == "EFFICIENT_ATTENTION" and params["attention/kernel_dh16"] == (
        "FLASH_ATTENTION"
    )


WIDE = [
    "model.d_model=768",
    "model.h_base=12",
    "model.ffn_hidden_size=2048",
    "schedule.heads=2x2,12x6",
    "schedule.allow_guideline_violations=true",  # d_h 384 breaks the head-dim guideline on purpose
]


def test_a_pinned_flash_is_refused_at_a_head_dim_the_device_cannot_run(monkeypatch):
    """On a GPU FlashAttention-2 takes head dims up to 256: with that fact in place of torch's probe (`runs`),
    the plan's d_h 384 layers are refused in one line naming the dim; every dim under it gets the pinned kernel.
    benchmarks/gpu_bench.sh asks a real GPU the same question."""
    probed = []

    def flash_up_to_the_limit(backend, head_dim, dtype, device):
        probed.append((backend.name, head_dim, dtype, device))
        return head_dim <= MAX_HEAD_DIM

    monkeypatch.setattr(sdpa_backend, "runs", flash_up_to_the_limit)
    with pytest.raises(ConfigError) as err:
        sdpa_backend.layer_kernels(load(*WIDE, "model.attention_backend=flash", "train.precision=bf16"), "cuda")
    assert "\n" not in str(err.value) and "flash attention cannot run on cuda (bf16, head dim 384)" in str(err.value)
    assert "use sdpa (torch chooses) or math" in str(err.value)
    assert [(b, d, dev) for b, d, _, dev in probed] == [
        ("FLASH_ATTENTION", 64, "cuda"),
        ("FLASH_ATTENTION", 384, "cuda"),
    ]
    assert probed[0][2] == torch.bfloat16  # asked at the training dtype
    cfg = load("model.attention_backend=flash", "train.precision=bf16")
    assert sdpa_backend.layer_kernels(cfg, "cuda") == ["FLASH_ATTENTION"] * cfg.model.num_layers


def test_cpus_flash_kernel_takes_head_dim_384():
    """torch's CPU flash kernel takes d_h 384: the same plan is not refused on CPU (torch's real answer)."""
    cfg = load(*WIDE, "model.attention_backend=flash", "train.precision=bf16")
    assert sdpa_backend.layer_kernels(cfg, "cpu") == ["FLASH_ATTENTION"] * cfg.model.num_layers


def test_a_memory_window_on_cpu_writes_the_op_table_and_a_snapshot_says_it_needs_cuda(tmp_path, monkeypatch, capsys):
    """CPU has no caching allocator to snapshot: the window's memory file is the profiler's per-op table, and
    a snapshot asked for anyway (the OOM path) is one line naming CUDA, with no file left behind (a process
    without CUDA is the fact injected, so a GPU box answers the same). benchmarks/gpu_bench.sh checks a real
    snapshot on a GPU."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.ones(256, 256).sum()
    table = profiling.write_memory(prof, tmp_path, 0, "cpu")
    assert table == tmp_path / "rank-0.memory.txt" and "Self CPU Mem" in table.read_text()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert profiling.dump_on_oom(tmp_path, step=7, rank=0) is None
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and line.startswith("prism train: rank 0: no memory snapshot after the OOM"), line
    assert "needs a CUDA device" in line
    assert [p.name for p in tmp_path.rglob("*")] == ["rank-0.memory.txt"]


def test_model_report_refuses_a_pinned_kernel_this_machine_cannot_run(capsys):
    from pipeline.cli import main

    assert main(["model", "report", TINY, "model.attention_backend=efficient"]) == 2
    err = capsys.readouterr().err.strip()
    assert "efficient attention cannot run on cpu" in err and "\n" not in err


def test_each_layer_gets_a_forward_and_a_backward_range_while_traced():
    import time

    from pipeline.model import build_model

    cfg = load()
    distributed.init_model_parallel(1, cfg.run.seed)
    model = build_model(cfg)
    tokens = torch.zeros(2, 16, dtype=torch.long)
    plain = model(tokens, None, None).float().sum()
    plain.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        handles = profiling.label_layers(model)
        traced = model(tokens, None, None).float().sum()
        start = time.perf_counter()
        traced.backward()
        backward_ms = 1e3 * (time.perf_counter() - start)
        for h in handles:
            h.remove()
    times = profiling.layer_times(prof, "cpu")
    assert list(times) == list(range(1, cfg.model.num_layers + 1))
    assert all(t["forward"] > 0 and t["backward"] > 0 for t in times.values())
    # the backward ranges hold the layers' backward, not just their hooks (embedding and loss are outside)
    assert 0.3 * backward_ms < sum(t["backward"] for t in times.values()) <= backward_ms
    assert torch.equal(plain, traced) and all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # off again


def test_a_stop_inside_a_window_writes_the_steps_traced_so_far(tmp_path):
    import gzip

    from pipeline.tracking import NullTracker

    cfg = load(f"run.output_dir={tmp_path}")
    distributed.init_model_parallel(1, cfg.run.seed)  # a one-rank process group: the window ends in a barrier
    prof = profiling.Profiler(cfg, 0, "cpu", NullTracker())
    profiling.write_request(cfg.run_dir, 3)
    assert prof.poll(sync_step=False) == 0.0  # not a sync step: the folder is not read
    prof.agreed(prof.poll(sync_step=True), step=1, total_steps=10)
    assert (prof.window.first, prof.window.last) == (2, 4)
    with prof.step(2):
        torch.ones(4).sum()
    prof.step_done(2)
    prof.cut(2)  # a stop signal after step 2
    window = cfg.run_dir / "profile" / "step-2-2"
    assert sorted(p.name for p in window.iterdir()) == ["rank-0.json.gz", "served.json"]
    events = json.loads(gzip.decompress((window / "rank-0.json.gz").read_bytes()))["traceEvents"]
    assert "prism_step#2" in {e.get("name") for e in events}
    assert prof.window is None and prof.step(3).__class__.__name__ == "nullcontext"  # back to normal


def test_plan_with_a_gpu_says_where_torch_answers_for_its_kernels(capsys):
    from pipeline.cli import main

    assert main(["plan", TINY, "--gpu", "H200"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("  attention")]
    if torch.cuda.is_available() and "H200" in torch.cuda.get_device_name():
        assert "attention on cuda" in line  # torch's answer for this very GPU
    else:
        assert f"run `prism model report {TINY} train.precision=fp32` on a node with that GPU (H200)" in line


def test_a_configured_window_a_resume_started_past_leaves_requests_open(tmp_path):
    from pipeline.tracking import NullTracker

    prof = profiling.Profiler(load(f"run.output_dir={tmp_path}", "train.profile_steps=[2,3]"), 0, "cpu", NullTracker())
    profiling.write_request(tmp_path / "prism-tiny-s1234", 1)
    assert prof.poll(sync_step=True) == 0.0  # the configured window comes first
    assert prof.step(5).__class__.__name__ == "nullcontext" and prof.window is None  # resumed at step 5
    assert profiling.decode(prof.poll(sync_step=True)) == (1, False)
