"""datatrove's Parquet and JSONL readers without its check of their required packages.

The check (PipelineStep.__new__) reads the metadata of every installed distribution, ~0.2 s per package name
per process here, about a tenth of a 2M-token build (benchmarks/bench_tokenize.py). pyarrow and the JSONL
reader's needs are Prism's own requirements, so the check cannot fail. Module-level classes, so the process
pool pickles them by name.
"""

from datatrove.pipeline.readers import JsonlReader, ParquetReader


class PrismParquetReader(ParquetReader):
    _requires_dependencies: list[str] = []


class PrismJsonlReader(JsonlReader):
    _requires_dependencies: list[str] = []
