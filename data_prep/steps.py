"""datatrove steps without datatrove's check of their required packages.

datatrove's ``PipelineStep.__new__`` checks the ``_requires_dependencies`` of every class in a step's MRO by
reading the metadata of every installed distribution: ~0.13 s per package name per process here, about a
tenth of a 6M-token build (benchmarks/bench_tokenize.py). A subclass's empty list does not stop it, since the
lists of the whole MRO are chained, so ``NoPackageScan.__new__`` goes around it. The packages in question
(pyarrow, tokenizers, and orjson through datatrove[io]) are Prism requirements, so the check cannot fail.
Module-level classes, so the process pool pickles them by name.
"""

from datatrove.pipeline.readers import JsonlReader, ParquetReader


class NoPackageScan:
    """First base of a datatrove step: construct it without datatrove's package scan."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)


class PrismParquetReader(NoPackageScan, ParquetReader):
    pass


class PrismJsonlReader(NoPackageScan, JsonlReader):
    pass
