"""Evaluation: zero-shot scoring of checkpoints through lm-evaluation-harness (`prism eval`, `zeroshot`, `lm`),
the in-run evals (`in_run`), the per-item result files and bits per byte (`items`), the offline task catalog
(`catalog`), what evals cost a run (`plan`, for `prism plan`) and the accuracy-vs-tokens comparison of the
arms (`comparison`, for `prism compare`)."""
