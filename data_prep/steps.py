"""datatrove steps without datatrove's check of their required packages, and readers of text and id only.

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


class NoFilePath:
    """A reader base whose documents carry no ``file_path``: the writer reads text and id alone, and datatrove
    resolves that path once per document (0.09 s of the 0.48 s of Python work in a 6.5M-token task, cProfile)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_file_path = False  # BaseDiskReader's switch; ParquetReader's constructor does not pass it on


class PrismParquetReader(NoPackageScan, NoFilePath, ParquetReader):
    def __init__(self, *args, read_metadata: bool = False, **kwargs):
        # The text and id columns only: on FineWeb the other columns (url, dump, date, ...) are most of each row.
        super().__init__(*args, read_metadata=read_metadata, **kwargs)


class PrismJsonlReader(NoPackageScan, NoFilePath, JsonlReader):
    pass
