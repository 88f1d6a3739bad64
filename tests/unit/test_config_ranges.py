"""Every number (and every name that becomes a path) is range-checked when the config loads: one line naming
the key, exit 2 through the CLI, before anything is built."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_prism.yaml"

# (override, the key the message must name). Values sit just outside each key's range.
BAD = [
    ("run.seed=-1", "run.seed"),
    ("run.seed=4294967296", "run.seed"),
    ("run.scale=../../x", "run.scale"),
    ("run.scale=a/b", "run.scale"),
    ("run.scale=''", "run.scale"),
    ("run.output_dir=''", "run.output_dir"),
    ("train.init_from=''", "train.init_from"),  # unset is null; an empty path is a mistake
    ("model.num_layers=0", "model.num_layers"),
    ("model.d_model=0", "model.d_model"),
    ("model.h_base=0", "model.h_base"),
    ("model.ffn_hidden_size=0", "model.ffn_hidden_size"),
    ("model.seq_len=0", "model.seq_len"),
    ("model.vocab_size=0", "model.vocab_size"),
    ("model.norm_eps=0", "model.norm_eps"),
    ("model.rope_base=1", "model.rope_base"),
    ("model.dropout=2.0", "model.dropout"),
    ("model.dropout=-0.1", "model.dropout"),
    ("model.init_std=0", "model.init_std"),
    ("parallel.tp=0", "parallel.tp"),
    ("parallel.zero_stage=4", "parallel.zero_stage"),
    ("parallel.timeout_s=0", "parallel.timeout_s"),
    ("parallel.init_timeout_s=-5", "parallel.init_timeout_s"),
    ("train.batch_tokens=0", "train.batch_tokens"),
    ("train.micro_batch_size=0", "train.micro_batch_size"),
    ("train.lr=0", "train.lr"),
    ("train.lr=-3e-4", "train.lr"),  # used to blame train.min_lr
    ("train.lr=.nan", "train.lr"),
    ("train.lr=.inf", "train.lr"),
    ("train.train_tokens=0", "train.train_tokens"),
    ("train.min_lr=-1e-5", "train.min_lr"),
    ("train.warmup_fraction=1.0", "train.warmup_fraction"),
    ("train.weight_decay=-0.1", "train.weight_decay"),
    ("train.beta1=1.0", "train.beta1"),
    ("train.beta2=-0.5", "train.beta2"),
    ("train.eps=0", "train.eps"),
    ("train.grad_clip=-1", "train.grad_clip"),
    ("train.log_every=0", "train.log_every"),
    ("train.val_every=0", "train.val_every"),
    ("train.val_tokens=0", "train.val_tokens"),
    ("train.prefetch=0", "train.prefetch"),
    ("train.peak_flops=0", "train.peak_flops"),
    ("train.z_loss=-1e-4", "train.z_loss"),
    ("train.skip_window=1", "train.skip_window"),
    ("train.skip_sigma=0", "train.skip_sigma"),
    ("train.max_skips_in_a_row=0", "train.max_skips_in_a_row"),
    ("data.dataset_dir=''", "data.dataset_dir"),
    ("data.input=''", "data.input"),
    ("data.tokenizer=''", "data.tokenizer"),
    ("data.eos_token=''", "data.eos_token"),
    ("data.limit=0", "data.limit"),
    ("data.limit=-2", "data.limit"),
    ("data.val_fraction=1.5", "data.val_fraction"),
    ("data.sequences_per_sample=0", "data.sequences_per_sample"),
    ("data.samples_per_shard=0", "data.samples_per_shard"),
    ("data.val_samples_per_shard=0", "data.val_samples_per_shard"),
    ("data.tasks=0", "data.tasks"),
    ("data.workers=0", "data.workers"),
    ("data.slurm.cpus_per_task=0", "data.slurm.cpus_per_task"),
    ("data.slurm.mem_per_cpu_gb=0", "data.slurm.mem_per_cpu_gb"),
    ("data.verify_on_start=sometimes", "data.verify_on_start"),
    ("data.allow_repeat=maybe", "data.allow_repeat"),
    ("tracking.milestones=[4.0,-1]", "tracking.milestones"),
    ("tracking.experiment=../elsewhere", "tracking.experiment"),
    ("checkpoint.every_steps=0", "checkpoint.every_steps"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last"),
    ("checkpoint.every_minutes=0", "checkpoint.every_minutes"),
    ("checkpoint.max_failed_saves=0", "checkpoint.max_failed_saves"),
    ("checkpoint.end_margin_s=-1", "checkpoint.end_margin_s"),
    ("checkpoint.async_save=sometimes", "checkpoint.async_save"),
    ("train.eval_every=-1", "train.eval_every"),
    ("train.eval_limit=0", "train.eval_limit"),
    ("train.eval_tasks=[piqa,mmlu]", "train.eval_tasks"),  # an unknown task
    ("train.eval_tasks=[]", "train.eval_every"),  # on a preset with eval_every set: no tasks to score
    ("checkpoint.keep_every_steps=-1", "checkpoint.keep_every_steps"),
    ("data.val_sets.heldout.tokens=0", "data.val_sets.heldout.tokens"),
]


@pytest.mark.parametrize(("override", "key"), BAD, ids=[o for o, _ in BAD])
def test_out_of_range_value_is_refused_naming_its_key(override, key):
    with pytest.raises(config.ConfigError) as e:
        config.load(TINY, ["train.eval_every=8", override])
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"{TINY}: {key}:"), message


def test_every_numeric_key_has_a_range():
    """A new numeric key without a RANGES entry fails here: the table is the one place ranges live."""
    cfg = config.load(TINY)
    numeric = {
        k for k, v in config.flatten(cfg.to_dict()).items() if isinstance(v, int | float) and not isinstance(v, bool)
    }
    numeric |= {"train.peak_flops", "tracking.milestones", "checkpoint.every_minutes"}  # None / a list in this preset
    numeric = {re.sub(r"^data\.val_sets\.[^.]+\.", "data.val_sets{}.", k) for k in numeric}  # per entry
    ranged = {k.removesuffix("[]") for k in config.RANGES}
    assert numeric - ranged == set()


CLI_REFUSALS = [
    ("train.val_every=0", "train.val_every"),  # ZeroDivisionError after the first step, before
    ("checkpoint.every_steps=0", "checkpoint.every_steps"),
    ("checkpoint.every_minutes=-5", "checkpoint.every_minutes"),
    ("train.lr=-1", "train.lr"),
    ("run.scale=../../x", "run.scale"),
    ("train.eval_tasks=[hellaswag,mmlu]", "train.eval_tasks"),
    ("train.eval_every=8", "train.eval_every"),  # tasks emptied below
]


# Runs `prism VERB` on each refusal in one interpreter (each fresh process would mostly be start-up): its exit
# code and stderr per call, a traceback included if one escapes, as JSON on the last stdout line.
IN_ONE_PROCESS = """
import contextlib, io, json, sys, traceback
from pipeline.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        except BaseException:
            code = None
            traceback.print_exc()
    results.append((code, err.getvalue()))
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def cli_refusals(tmp_path_factory):
    """`prism plan` and `prism train` on every refusal: {(override, verb): (returncode, stderr, output_dir)}.
    All calls share one process; the first refusal also runs as its own `python -m pipeline.cli` for each verb
    (key (override, verb, "own process")), where stderr is the real stream: import-time noise shows there."""

    def argv(verb, override, out):
        return [verb, str(TINY), "train.eval_tasks=[]", override, f"run.output_dir={out}"]

    def start(*command):
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)

    calls = [
        ((override, verb), tmp_path_factory.mktemp("refused"))
        for override, _ in CLI_REFUSALS
        for verb in ("plan", "train")
    ]
    batch = start(sys.executable, "-c", IN_ONE_PROCESS, json.dumps([argv(verb, o, out) for (o, verb), out in calls]))
    override = CLI_REFUSALS[0][0]
    own = {}
    for verb in ("plan", "train"):
        out = tmp_path_factory.mktemp("refused-own-process")
        own[override, verb, "own process"] = (
            out,
            start(sys.executable, "-m", "pipeline.cli", *argv(verb, override, out)),
        )
    stdout, stderr = batch.communicate(timeout=300)
    assert batch.returncode == 0 and stdout.strip(), stderr
    answers = json.loads(stdout.strip().splitlines()[-1])
    results = {key: (code, err, out) for (key, out), (code, err) in zip(calls, answers, strict=True)}
    for key, (out, proc) in own.items():
        _, stderr = proc.communicate(timeout=300)
        results[key] = proc.returncode, stderr, out
    return results


def assert_refused(result, key):
    returncode, stderr, out = result
    assert returncode == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and f"{key}:" in lines[0] and "Traceback" not in stderr, stderr
    # no run folder, no checkpoint, no store (the console's logs/ folder may exist)
    assert [p.name for p in out.iterdir() if p.name != "logs"] == []


@pytest.mark.parametrize(("override", "key"), CLI_REFUSALS, ids=[o for o, _ in CLI_REFUSALS])
def test_cli_exits_2_with_one_line_before_anything_runs(override, key, cli_refusals):
    # plan answers without torch, train loads the config the same way: both refuse before anything runs
    for verb in ("plan", "train"):
        assert_refused(cli_refusals[override, verb], key)


@pytest.mark.parametrize("verb", ["plan", "train"])
def test_a_refusal_in_its_own_process_is_one_line_on_stderr(verb, cli_refusals):
    override, key = CLI_REFUSALS[0]
    assert_refused(cli_refusals[override, verb, "own process"], key)
