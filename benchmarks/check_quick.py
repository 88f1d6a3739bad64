"""`make bench-quick`: run every benchmark at its --quick size and check that each exits 0 and reports its
fields. Never a timing: the figures are printed for people, the check is that they are there.

    python benchmarks/check_quick.py                 # all of benchmarks/bench_*.py
    python benchmarks/check_quick.py bench_loss      # some of them

Each benchmark's output streams through (prefixed with its name); its last `BENCH name {json}` line is
checked against FIELDS: every listed field present and a number > 0 (dotted names reach into nested objects).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

FIELDS = {
    "bench_arms": [
        "ratio_prism_over_uniform_tokens_per_sec",
        "arms.prism.tokens_per_sec",
        "arms.uniform.tokens_per_sec",
        "arms.prism.mfu",
        "arms.prism.peak_memory_gb",
        "arms.uniform.peak_memory_gb",
    ],
    "bench_checkpoint": [
        "ratio_blocked_non_blocking_over_sync",
        "sync_blocked_s",
        "non_blocking_blocked_s",
        "non_blocking_background_s",
        "bytes_per_save",
    ],
    "bench_loss": [
        "fp32_logits_mb",
        *(f"{d}_{f}" for d in ("bf16", "fp32") for f in ("peak_mb_megatron_fp32", "peak_mb_chunked", "peak_drop_mb")),
        "bf16_peak_ratio_chunked_over_megatron",
        "fp32_peak_ratio_chunked_over_megatron",
        "step_s_megatron_fp32",
        "step_s_chunked",
        "time_ratio_chunked_over_megatron",
    ],
    "bench_model": ["prism_tok_s", "uniform_tok_s", "ratio"],
    "bench_tokenize": [
        *(
            f"tasks{n}.{f}"
            for n in (1, 2)
            for f in (
                "raw_tokens_per_s",
                "end_to_end_tokens_per_s",
                "ratio_end_to_end",
                "ratio_in_tasks",
                "end_to_end_s",
                "imports_s",
                "executor_s",
                "task_s",
                "task_writer_s",
                "task_untimed_s",
            )
        ),
        "scaling_1_to_2_tasks",
        "writer_parts_s.encode_batch_s",
        "writer_parts_s.packing_s",
        "writer_parts_s.tar_and_sha256_s",
    ],
    "bench_train": ["prism_train_step_s", "bare_pytorch_step_s", "step_time_ratio", "loader_tokens_per_s_one_core"],
}


def reported(name: str, output: str) -> dict | None:
    """The fields of the last `BENCH name {json}` line of ``output``."""
    prefix = f"BENCH {name} "
    lines = [line for line in output.splitlines() if line.startswith(prefix)]
    return json.loads(lines[-1][len(prefix) :]) if lines else None


def problems(name: str, output: str) -> list[str]:
    """What is missing from a benchmark's output (empty: it reported every field of FIELDS[name])."""
    fields = reported(name, output)
    if fields is None:
        return [f"{name}: no `BENCH {name} {{...}}` line in its output"]
    found = []
    for dotted in FIELDS[name]:
        value = fields
        for key in dotted.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            found.append(f"{name}: field {dotted} is {value!r}, not a number > 0")
    return found


def run(name: str) -> tuple[int, str]:
    """Run benchmarks/NAME.py --quick, streaming its output; returns (exit code, output)."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / f"{name}.py"), "--quick"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        print(f"{name} | {line}", end="", flush=True)
    return proc.wait(), "".join(lines)


def main(names: list[str]) -> int:
    unknown = sorted(set(names) - set(FIELDS))
    if unknown:
        print(f"check_quick: no benchmark {', '.join(unknown)}; choose from {', '.join(FIELDS)}", file=sys.stderr)
        return 2
    on_disk = sorted(p.stem for p in HERE.glob("bench_*.py"))
    if sorted(FIELDS) != on_disk:  # a new benchmark needs its fields listed here, or CI would not run it
        print(f"check_quick: FIELDS lists {sorted(FIELDS)}, benchmarks/ holds {on_disk}", file=sys.stderr)
        return 2
    failed, summary = [], []
    for name in names or on_disk:
        start = time.perf_counter()
        code, output = run(name)
        found = ([f"{name}: exit code {code}"] if code else []) + problems(name, output)
        failed += found
        summary.append(f"{name}: {'ok' if not found else 'FAILED'} ({time.perf_counter() - start:.0f} s)")
    print("check_quick: " + "; ".join(summary))
    for line in failed:
        print(f"check_quick: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
