"""Runs: the one way every policy (the demo, `prism study`, `prism sweep`, `prism search`) plans, launches and
reads `prism train` runs. The policies say only what they add: the demo its data, the study its statistics,
the sweep its job array, the search its ASHA.

  plan.py       what to run: presets, schedules and overrides read through `config.load`, the grid, and
                which runs already finished (config.result_hash)
  spec_file.py  the YAML spec reader sweeps and searches share (a bad field is `SPEC:LINE:COLUMN`)
  launch.py     where runs run: a local pool, detached local runs, submitit jobs on Slurm; torchrun's signals
  outcome.py    how a run ended and what it measured: exit record, offline journal, MLflow
"""
