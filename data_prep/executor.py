"""The datatrove side of `prism prepare`: the pipeline (reader -> TokenizeToShards) and the executor that runs
it, local or Slurm, plus the dependent Slurm job that writes manifest.json. data_prep.build decides what to
build and when; this module only says how datatrove runs it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from data_prep.manifest import WriteManifest
from data_prep.tokenize_to_shards import TokenizeToShards
from pipeline.config import Config
from pipeline.dataset import DataError

# the files of data.input each data.input_format reads (the reader, and check_input before it)
INPUT_GLOBS = {"parquet": "**/*.parquet", "embedded": "**/*.parquet", "jsonl": "**/*.jsonl*"}


def build_pipeline(cfg: Config, tokenizer_path: str, ident: dict[str, Any], eos_id: int) -> list:
    from data_prep.steps import PrismJsonlReader, PrismParquetReader

    d = cfg.data
    reader_cls = PrismJsonlReader if d.input_format == "jsonl" else PrismParquetReader
    reader = reader_cls(
        d.input, limit=d.limit, text_key=d.text_key, id_key=d.id_key, glob_pattern=INPUT_GLOBS[d.input_format]
    )
    writer = TokenizeToShards(
        dataset_dir=str(Path(d.dataset_dir).resolve()),
        tokenizer_name_or_path=str(Path(tokenizer_path).resolve()),
        eos_id=eos_id,
        seq_len=cfg.model.seq_len,
        sequences_per_sample=d.sequences_per_sample,
        samples_per_shard={"train": d.samples_per_shard, "val": d.val_samples_per_shard},
        val_fraction=d.val_fraction,
        dtype=ident["dtype"],
        encode_threads=encode_threads(cfg),
    )
    return [reader, writer]


def encode_threads(cfg: Config) -> int | None:
    """Tokenizer threads per task. Local tasks running side by side split this machine's cores between them
    (the tokenizer's default is every core in each task: N tasks would run N x cores threads); None otherwise
    (one task at a time, or Slurm, where each task has its own cpus_per_task)."""
    d = cfg.data
    side_by_side = min(d.tasks, d.workers if d.workers > 0 else d.tasks)
    if d.executor != "local" or side_by_side < 2:
        return None
    return max(1, len(os.sched_getaffinity(0)) // side_by_side)


def build_executor(cfg: Config, pipeline: list, logs_dir: Path):
    """The configured datatrove executor around ``pipeline`` (the same list for local and Slurm)."""
    d = cfg.data
    if d.executor == "local":
        from datatrove.executor import LocalPipelineExecutor

        # fork, not datatrove's default forkserver: forkserver re-imports __main__ and hangs unguarded scripts.
        return LocalPipelineExecutor(
            pipeline, tasks=d.tasks, workers=d.workers, logging_dir=str(logs_dir), start_method="fork"
        )
    from datatrove.executor import SlurmPipelineExecutor

    s = d.slurm
    if not s.partition:
        raise DataError("data.executor=slurm needs data.slurm.partition; set it, e.g. data.slurm.partition=cpu")
    import sys

    return SlurmPipelineExecutor(
        pipeline,
        tasks=d.tasks,
        workers=d.workers,
        time=s.time,
        partition=s.partition,
        cpus_per_task=s.cpus_per_task,
        mem_per_cpu_gb=s.mem_per_cpu_gb,
        sbatch_args=dict(s.sbatch_args),
        max_array_launch_parallel=s.max_array_launch_parallel,
        logging_dir=str(logs_dir),
        job_name=f"prism-prepare-{Path(d.dataset_dir).name}",
        venv_path=str(Path(sys.prefix) / "bin" / "activate"),
    )


def build_manifest_executor(cfg: Config, shards_executor, logs_dir: Path):
    """Slurm: a one-task job that depends on the shard array and writes manifest.json."""
    from datatrove.executor import SlurmPipelineExecutor

    s = cfg.data.slurm
    return SlurmPipelineExecutor(
        [WriteManifest(str(Path(cfg.data.dataset_dir).resolve()))],
        tasks=1,
        time="00:30:00",
        partition=s.partition,
        cpus_per_task=1,
        mem_per_cpu_gb=s.mem_per_cpu_gb,
        sbatch_args=dict(s.sbatch_args),
        logging_dir=str(logs_dir.with_name("manifest-logs")),
        job_name=f"prism-manifest-{Path(cfg.data.dataset_dir).name}",
        venv_path=shards_executor.venv_path,
        depends=shards_executor,
    )
