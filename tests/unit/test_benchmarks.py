"""The benchmarks' own machinery: the live-tensor byte count bench_loss reports, and the field check that
`make bench-quick` (CI) applies to every benchmark's output."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_loss  # noqa: E402
import check_quick  # noqa: E402


def test_live_tensor_bytes_counts_storages_until_they_are_freed():
    with bench_loss.LiveTensorBytes() as mode:
        a = torch.ones(1000)  # 4000 bytes
        b = a * 2  # 4000 more
        view = b[10:]  # shares b's storage: nothing new
        b.mul_(3)  # in place: nothing new
        assert mode.live == 8000
        del a
        assert mode.live == 4000
        c = torch.zeros(500, dtype=torch.bfloat16)  # 1000 bytes, under the old peak
        del b, view, c
    assert (mode.peak, mode.live) == (8000, 0)


@pytest.fixture
def model_parallel():
    from pipeline import distributed

    distributed.init_model_parallel(1, 1234)  # megatron's cross-entropy asks for the TP group


@pytest.mark.parametrize("arm", sorted(bench_loss.ARMS))
def test_meta_device_count_equals_the_count_of_a_real_run(model_parallel, arm):
    """The full-shape memory figures come from the meta device: at a small shape they match real tensors."""
    path = bench_loss.ARMS[arm]
    peaks = {
        device: bench_loss.counted_peak(path, *bench_loss.inputs(2, 64, 32, 1000, torch.float32, device))
        for device in ("meta", "cpu")
    }
    assert peaks["meta"] > 2 * 64 * 1000 * 4 * (arm == "megatron_fp32")  # megatron: >= fp32 logits
    # On CPU, megatron's cross-entropy all-reduces three [b, s] fp32 vectors over gloo, whose worker thread
    # drops its hold on a finished all-reduce a moment after wait() returns: now and then one of them is
    # still alive at the peak (+512 bytes in a clean-clone CI run). The meta device has no such thread.
    reduced = 3 * 2 * 64 * 4 if arm == "megatron_fp32" else 0
    assert peaks["meta"] <= peaks["cpu"] <= peaks["meta"] + reduced, peaks


def _output(name: str, fields: dict) -> str:
    return f"progress line\nBENCH {name} {json.dumps(fields)}\n"


def test_check_quick_accepts_every_field_and_names_a_missing_or_empty_one():
    full = {"prism_tok_s": 310.5, "uniform_tok_s": 280.0, "ratio": 1.1}
    assert check_quick.problems("bench_model", _output("bench_model", full)) == []
    assert check_quick.problems("bench_model", _output("bench_model", {**full, "ratio": 0})) == [
        "bench_model: field ratio is 0, not a number > 0"
    ]
    missing = {k: v for k, v in full.items() if k != "uniform_tok_s"}
    assert check_quick.problems("bench_model", _output("bench_model", missing)) == [
        "bench_model: field uniform_tok_s is None, not a number > 0"
    ]
    assert check_quick.problems("bench_model", "a traceback\n") == [
        "bench_model: no `BENCH bench_model {...}` line in its output"
    ]


def test_check_quick_reads_nested_fields():
    fields = {name: 1.0 for name in check_quick.FIELDS["bench_tokenize"] if "." not in name}
    for dotted in check_quick.FIELDS["bench_tokenize"]:
        if "." in dotted:
            outer, inner = dotted.split(".")
            fields.setdefault(outer, {})[inner] = 0.5
    assert check_quick.problems("bench_tokenize", _output("bench_tokenize", fields)) == []
    fields["tasks2"]["ratio_in_tasks"] = float("nan")
    assert check_quick.problems("bench_tokenize", _output("bench_tokenize", fields)) == [
        "bench_tokenize: field tasks2.ratio_in_tasks is nan, not a number > 0"
    ]


def test_check_quick_knows_every_benchmark():
    on_disk = sorted(p.stem for p in Path(check_quick.__file__).parent.glob("bench_*.py"))
    assert sorted(check_quick.FIELDS) == on_disk
