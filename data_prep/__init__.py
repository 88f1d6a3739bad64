"""Data preparation: datatrove reads documents, tokenises and packs them into webdataset shards + manifest.

Import-light on purpose (``prism --help`` imports the CLI): the heavy modules load on first call.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.config import Config


def prepare(cfg: Config, overwrite: bool = False, quiet: bool = False) -> Path:
    """Build (or resume) ``cfg.data.dataset_dir``; returns the path of its manifest.json."""
    from data_prep.build import prepare as _prepare

    return _prepare(cfg, overwrite=overwrite, quiet=quiet)


def verify(dataset_dir: str | Path) -> list[str]:
    """Re-hash a dataset's shards against its manifest; returns the problems found (empty: valid)."""
    from data_prep.manifest import verify as _verify

    return _verify(dataset_dir)


__all__ = ["prepare", "verify"]
