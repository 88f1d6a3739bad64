"""Tokens/s of the whole `prism prepare` pipeline vs. raw `tokenizers` encoding of the same documents, and where
the difference goes.

    python benchmarks/bench_tokenize.py            # a 24 MB embedded corpus + 8k BPE (cached in runs/bench)
    python benchmarks/bench_tokenize.py --quick    # a 6 MB corpus, one repetition (under a minute)
    python benchmarks/bench_tokenize.py --config CONFIG [overrides...]   # that config's input and tokenizer

For N = 1 and 2 tasks, both sides run N processes on the same cores, each owning the parquet files datatrove
gives that rank (files[rank::N]); the raw side has the texts in memory already and only calls encode_batch
(1,000 documents a call: 256 a call, or two calls at a time, measured the same here). Printed in one run: the
ratio pipeline / raw per N (target >= 0.90), "end to end" = the whole prepare() call (checks, executor,
manifest), "in tasks" = the slowest task's wall time, and the pipeline's scaling from 1 to 2 tasks. The two
sides alternate, best of --repeats each (the machine is shared: ratios within one run, not absolute rates,
are the figures).

Where the end-to-end time goes, per N (from the pipeline run): interpreter start-up and imports (datatrove,
Prism; before prepare, left out of end to end, as the raw side's process start and imports are), checks
(tokenizer hash, input schemas, build state), pipeline construction, executor (start + tasks + stats), the
slowest task's wall time split into its reader and writer timers (datatrove's step timings) and what falls
outside both (tokenizer load, the first batch's encoding, the last batch's packing, the rank record), the
executor's own overhead around the tasks (process pool, task loggers, stats files), and the manifest. Then
the writer's parts, measured one at a time in this process over the whole corpus: encode_batch, packing (ids
to numpy, split, rows), tar encoding + sha256, and file writes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, bpe_tokenizer, embedded_corpus, quiet_datatrove, refuse, report, say

PROG = "bench_tokenize"
TASKS = (1, 2)


# --- raw encode_batch ---------------------------------------------------------------------------------
def _raw_encode(tokenizer_path: str, files: list[Path], text_key: str, batch: int, ready, results) -> None:
    """Child: read its share and load the tokenizer, wait for the start, encode, report its token count."""
    from tokenizers import Tokenizer

    texts = read_texts(files, text_key)
    tok = Tokenizer.from_file(tokenizer_path)
    tok.encode_special_tokens = True
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # the call the pipeline makes
    ready.wait()
    results.put(sum(len(e.ids) + 1 for i in range(0, len(texts), batch) for e in encode(texts[i : i + batch])))


def read_texts(files: list[Path], text_key: str) -> list[str]:
    import pyarrow.parquet as pq

    return [t for f in files for t in pq.read_table(f, columns=[text_key]).column(text_key).to_pylist()]


def raw_tokens_per_sec(tokenizer_path: str, files: list[Path], tasks: int, text_key: str, batch: int) -> float:
    """N fresh interpreters (spawn), each owning files[rank::N] in memory, released together; the clock runs
    from the release to the last count. Spawned, not forked: tokenizers turns its thread pool off in a child
    forked from a process that already used it (this one trains the BPE), which made the raw side slower."""
    ctx = mp.get_context("spawn")
    ready, results = ctx.Barrier(tasks + 1), ctx.Queue()
    children = [
        ctx.Process(target=_raw_encode, args=(tokenizer_path, files[r::tasks], text_key, batch, ready, results))
        for r in range(tasks)
    ]
    for c in children:
        c.start()
    ready.wait()
    start = time.perf_counter()
    tokens = sum(results.get() for _ in children)
    elapsed = time.perf_counter() - start
    for c in children:
        c.join()
    return tokens / elapsed


# --- the pipeline, one prepare() in a fresh interpreter ---------------------------------------------------
def pipeline_run(cfg_path: str, overrides: list[str], tasks: int, out: Path) -> dict:
    """A process that already used tokenizers' thread pool makes its forked children single-threaded, which
    would skew whichever side runs later: so prepare() runs in its own interpreter."""
    args = [*overrides, f"data.dataset_dir={out}", f"data.tasks={tasks}", f"data.workers={tasks}"]
    task_log = out.with_suffix(".tasks.jsonl")
    spawned = time.time()
    done = subprocess.run(
        [sys.executable, __file__, "--pipeline-once", str(task_log), cfg_path, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"{PROG}: prepare with data.tasks={tasks} failed:\n{done.stderr[-3000:]}")
    phases = json.loads(done.stdout.strip().splitlines()[-1])
    manifest = json.loads((out / "manifest.json").read_text())
    # the slowest task's step times: tasks run in parallel, so the wall clock follows the slowest
    per_task = [json.loads(p.read_text()) for p in sorted((out / ".prep" / "logs" / "stats").glob("*.json"))]
    slowest = max(per_task, key=lambda steps: sum(s["time_stats"]["total"] for s in steps))
    reader, writer = (s["time_stats"]["total"] for s in slowest)
    task_wall = max(json.loads(line)["seconds"] for line in task_log.read_text().splitlines())
    tokens = manifest["totals"]["tokens_encoded"]
    return {
        "tokens": tokens,
        "startup_s": phases["started"] - spawned,
        "imports_s": phases["imports"],
        "end_to_end_s": phases["prepare"],
        "checks_s": phases["prepare"] - phases["build_pipeline"] - phases["executor"] - phases["manifest"],
        "build_pipeline_s": phases["build_pipeline"],
        "executor_s": phases["executor"],
        "task_s": task_wall,
        "task_reader_s": reader,
        "task_writer_s": writer,
        "task_untimed_s": task_wall - reader - writer,
        "executor_overhead_s": phases["executor"] - task_wall,
        "manifest_s": phases["manifest"],
    }


def _pipeline_once(task_log: str, cfg_path: str, overrides: list[str]) -> None:
    """Child: prepare() with its phases timed (wrappers around build's own functions), and each task's wall
    time, from the writer's first document to its rank record, appended to ``task_log`` by the task itself
    (tasks may run in forked workers)."""
    started = time.time()
    from data_prep import build
    from data_prep.tokenize_to_shards import TokenizeToShards
    from pipeline import config

    plain_writer_run = TokenizeToShards.run

    def timed_writer_run(self, data, rank=0, world_size=1):
        t = time.perf_counter()
        yield from plain_writer_run(self, data, rank, world_size)
        with open(task_log, "a") as f:
            f.write(json.dumps({"rank": rank, "seconds": time.perf_counter() - t}) + "\n")

    TokenizeToShards.run = timed_writer_run

    quiet_datatrove()
    phases = {"started": started, "imports": time.time() - started, "executor": 0.0}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[name] = time.perf_counter() - t

        return wrapper

    def build_executor(*args, **kwargs):
        executor = plain_build_executor(*args, **kwargs)
        executor.run = timed("executor", executor.run)
        return executor

    plain_build_executor = build.build_executor
    build.build_pipeline = timed("build_pipeline", build.build_pipeline)
    build.build_executor = build_executor
    build.write_manifest = timed("manifest", build.write_manifest)
    cfg = config.load(cfg_path, overrides)
    timed("prepare", build.prepare)(cfg, quiet=True)
    print(json.dumps(phases))


# --- the writer's parts, one at a time ---------------------------------------------------------------------
def writer_parts(cfg, tokenizer_path: str, out: Path) -> dict:
    """Serial seconds over the whole corpus for each part of TokenizeToShards, with its own functions."""
    from data_prep.build import build_pipeline, data_identity, tokenizer_info
    from data_prep.tokenize_to_shards import _SplitPacker, encode_tar, is_val
    from pipeline.atomic import write_atomic

    tok_info = tokenizer_info(tokenizer_path, cfg.data.eos_token, cfg.model.vocab_size)
    ident = data_identity(cfg, tok_info)
    reader, writer = build_pipeline(cfg, tokenizer_path, ident, tok_info["eos_id"])
    t = time.perf_counter()
    docs = list(reader.run(None, 0, 1))
    parts = {"reader_s": time.perf_counter() - t}

    tok = writer.tokenizer  # as the tasks load it
    tok.encode_special_tokens = True
    eos_id = writer.eos_id
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    batch = writer.batch_size
    t = time.perf_counter()
    encodings = [e for i in range(0, len(docs), batch) for e in encode([d.text for d in docs[i : i + batch]])]
    parts["encode_batch_s"] = time.perf_counter() - t

    shards = []
    packers = {
        split: _SplitPacker(
            split, 0, out, cfg.model.seq_len, cfg.data.sequences_per_sample, per_shard, ident["dtype"], eos_id
        )
        for split, per_shard in (("train", cfg.data.samples_per_shard), ("val", cfg.data.val_samples_per_shard))
    }
    for p in packers.values():
        p._write_shard = shards.append  # packing only: the shards are kept for the next parts
    t = time.perf_counter()
    for doc, enc in zip(docs, encodings):
        packers["val" if is_val(str(doc.id), cfg.data.val_fraction) else "train"].add(enc.ids)
    parts["packing_s"] = time.perf_counter() - t

    import hashlib

    t = time.perf_counter()
    tars = [encode_tar(s, f"bench-{i:06d}") for i, s in enumerate(shards)]
    for data in tars:
        hashlib.sha256(data).hexdigest()
    parts["tar_and_sha256_s"] = time.perf_counter() - t
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    for i, data in enumerate(tars):
        write_atomic(out / f"shard-{i:06d}.tar", data)
    parts["file_writes_s"] = time.perf_counter() - t
    return parts


# --- main ----------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 6 MB corpus, one repetition")
    ap.add_argument("--corpus-mb", type=float, default=None, help="embedded corpus size (default 24, quick 6)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per side and task count, best kept (2, quick 1)")
    ap.add_argument("--config", default=None, help="use this config's data.input and data.tokenizer")
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value), with --config")
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.quick else 2)
    cfg_path = args.config or str(ROOT / "configs" / "tiny_prism.yaml")
    say(
        f"{PROG}: tokens/s of prism prepare end to end and in its tasks vs raw encode_batch, tasks {TASKS}, "
        f"best of {repeats}; then where the time goes"
    )

    from data_prep.build import prepare_inputs
    from pipeline import config
    from pipeline.config import ConfigError

    quiet_datatrove()
    overrides = list(args.overrides)
    if args.config is None:
        corpus = embedded_corpus(args.corpus_mb or (6 if args.quick else 24))
        overrides = [f"data.input={corpus}", "data.input_format=parquet", f"data.tokenizer={bpe_tokenizer(corpus)}"]
        overrides.append("data.val_sets={}")  # the tiny preset's held-out set would be a second, untimed build
    try:
        cfg = config.load(cfg_path, overrides)
        tokenizer_path = prepare_inputs(cfg)  # the embedded format builds its corpus / tokenizer when missing
    except ConfigError as e:
        refuse(PROG, str(e))
    files = sorted(Path(cfg.data.input).glob("**/*.parquet"))
    if not files:
        refuse(PROG, f"data.input={cfg.data.input}: no parquet files; point --config / data.input at some")
    say(
        f"corpus: {len(files)} parquet files, {sum(f.stat().st_size for f in files) / 1e6:.1f} MB; tokenizer "
        f"{tokenizer_path}; {len(os.sched_getaffinity(0))} CPUs"
    )
    fields: dict = {"cpus": len(os.sched_getaffinity(0)), "repeats": repeats}
    tmp = Path(tempfile.mkdtemp(prefix="bench_tokenize-"))
    try:
        for tasks in TASKS:
            raw, best = 0.0, None
            for rep in range(repeats):
                raw = max(raw, raw_tokens_per_sec(tokenizer_path, files, tasks, cfg.data.text_key, 1000))
                run = pipeline_run(cfg_path, overrides, tasks, tmp / f"ds{tasks}-{rep}")
                if best is None or run["end_to_end_s"] < best["end_to_end_s"]:
                    best = run
                say(f"tasks={tasks}: repetition {rep + 1}/{repeats} done")
            e2e = best["tokens"] / best["end_to_end_s"]
            in_tasks = best["tokens"] / best["task_s"]
            fields[f"tasks{tasks}"] = {
                "raw_tokens_per_s": round(raw),
                "end_to_end_tokens_per_s": round(e2e),
                "ratio_end_to_end": round(e2e / raw, 3),
                "ratio_in_tasks": round(in_tasks / raw, 3),
                **{k: round(v, 3) for k, v in best.items() if k.endswith("_s")},
                "tokens": best["tokens"],
            }
            r = fields[f"tasks{tasks}"]
            print(
                f"tasks={tasks}: raw encode_batch {raw:,.0f} tokens/s; pipeline end to end {e2e:,.0f} tokens/s, "
                f"ratio {r['ratio_end_to_end']:.2f}; in tasks ratio {r['ratio_in_tasks']:.2f} (target >= 0.90; "
                f"{best['tokens']:,} tokens)",
                flush=True,
            )
            print(
                f"tasks={tasks}: seconds: start-up {r['startup_s']:.2f}, imports {r['imports_s']:.2f} (datatrove, "
                f"Prism; neither in end to end, as the raw side's are not) | end to end "
                f"{r['end_to_end_s']:.2f} = checks {r['checks_s']:.2f} + pipeline construction "
                f"{r['build_pipeline_s']:.2f} + executor {r['executor_s']:.2f} (slowest task {r['task_s']:.2f}: "
                f"reader {r['task_reader_s']:.2f}, writer {r['task_writer_s']:.2f}, outside both timers "
                f"{r['task_untimed_s']:.2f}; executor around the tasks {r['executor_overhead_s']:.2f}) + manifest "
                f"{r['manifest_s']:.2f}",
                flush=True,
            )
        fields["scaling_1_to_2_tasks"] = round(
            fields["tasks2"]["end_to_end_tokens_per_s"] / fields["tasks1"]["end_to_end_tokens_per_s"], 3
        )
        print(f"scaling 1 -> 2 tasks (end to end): {fields['scaling_1_to_2_tasks']:.2f}x", flush=True)
        say("writer parts, one at a time over the whole corpus in this process")
        parts = writer_parts(config.load(cfg_path, overrides), tokenizer_path, tmp / "parts")
        fields["writer_parts_s"] = {k: round(v, 3) for k, v in parts.items()}
        print("writer parts (s): " + ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in parts.items()))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(PROG, fields)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--pipeline-once"]:
        _pipeline_once(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        main()
