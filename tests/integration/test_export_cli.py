"""`prism export` / `prism generate` / `train.init_from` on the real 2-step tiny checkpoints: the folder
loads in a fresh Python with plain transformers (uniform) or remote code (Prism) and gives the trainer's
logits, lm-eval's own HF backend scores it as `prism eval` scores the checkpoint, exported weights start a
new run, and bad input is one line with nothing left behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
ARMS = {"prism": "PrismForCausalLM", "uniform": "StableLmForCausalLM"}

# Run in a fresh interpreter: only transformers, none of this repository's modules.
LOAD_AND_SCORE = """
import sys, torch
from transformers import AutoModelForCausalLM
folder, remote, tokens_file, out_file = sys.argv[1], sys.argv[2] == "1", sys.argv[3], sys.argv[4]
model = AutoModelForCausalLM.from_pretrained(folder, **({"trust_remote_code": True} if remote else {})).eval()
assert not any(m.startswith("pipeline") for m in sys.modules)
with torch.no_grad():
    torch.save({"class": type(model).__name__, "logits": model(torch.load(tokens_file)).logits}, out_file)
"""


def prism(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipeline.cli", *args]
    return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)


def error_line(result: subprocess.CompletedProcess, verb: str) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"prism {verb}: error: "), result.stderr[-2000:]
    return lines[0]


@pytest.fixture(scope="module")
def exports(tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("exports")
    for arm in ARMS:
        result = prism("export", str(getattr(tiny_checkpoints, arm)), "--out", str(out / arm))
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"wrote {out / arm}" in result.stdout
    return out


def trainer_logits(checkpoint: Path, tokens: torch.Tensor) -> torch.Tensor:
    from pipeline.inference import load_checkpoint
    from pipeline.model import logits

    _, model, _ = load_checkpoint(checkpoint, device="cpu")
    with torch.no_grad():
        return logits(model, tokens)


@pytest.mark.parametrize("arm", ARMS)
def test_export_loads_in_fresh_python_with_the_trainers_logits(arm, exports, tiny_checkpoints, tmp_path):
    folder = exports / arm
    names = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= names
    assert {"tokenizer_config.json", "README.md"} <= names
    assert ("modeling_prism.py" in names) == (arm == "prism")
    assert not any(p.name.startswith(".") for p in folder.parent.iterdir())  # no temporary folder left
    card = (folder / "README.md").read_text()
    run_id = json.loads((getattr(tiny_checkpoints, arm) / "tracking-state.json").read_text())["run_id"]
    assert run_id in card and "tokens seen: 2,048" in card and "final val loss: " in card
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|endoftext|>"
    from mlflow.tracking import MlflowClient  # the folder is an artifact of the checkpoint's own run

    logged = {a.path for a in MlflowClient(tiny_checkpoints.tracking_uri(arm)).list_artifacts(run_id, f"hf/{arm}")}
    assert {f"hf/{arm}/model.safetensors", f"hf/{arm}/config.json", f"hf/{arm}/tokenizer.json"} <= logged

    tokens = torch.randint(0, 8192, (2, 128), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    remote = "1" if arm == "prism" else "0"
    cmd = [
        sys.executable,
        "-c",
        LOAD_AND_SCORE,
        str(folder),
        remote,
        str(tmp_path / "tokens.pt"),
        str(tmp_path / "o.pt"),
    ]
    result = subprocess.run(cmd, cwd=tmp_path, env={**ENV, "PYTHONPATH": ""}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    got = torch.load(tmp_path / "o.pt")
    assert got["class"] == ARMS[arm]
    want = trainer_logits(getattr(tiny_checkpoints, arm), tokens)
    relative = ((got["logits"] - want).abs().max() / want.abs().max()).item()
    print(f"{arm}: max |transformers - trainer| / max |trainer| = {relative:.2e}")
    assert relative <= 1e-4


def test_generate_streams_a_greedy_continuation(exports, tiny_checkpoints):
    from pipeline.export.generate import generate

    result = prism(
        "generate", str(exports / "uniform"), "--prompt", "The river", "--max-new-tokens", "8", "--temperature", "0"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("The river")  # the streamer prints the prompt, then the new text
    from_checkpoint = prism(
        "generate",
        str(tiny_checkpoints.uniform),
        "--prompt",
        "The river",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
    )
    assert from_checkpoint.returncode == 0 and from_checkpoint.stdout == result.stdout
    continuation = generate(exports / "uniform", "The river", 8, temperature=0.0, stream=False)
    assert result.stdout == f"The river{continuation}\n"  # the streamer: prompt, new text, a newline
    assert len(continuation) > 0


def test_lm_eval_hf_backend_agrees_with_prism_eval(exports, tiny_checkpoints, tmp_path):
    """lm-eval's stock HF model on the export and our adapter on the checkpoint: the same answers."""
    import lm_eval

    from pipeline.eval.zeroshot import evaluate_checkpoint, task_manager

    tasks, limit = ["piqa", "arc_easy"], 16
    for arm in ARMS:
        ours = evaluate_checkpoint(getattr(tiny_checkpoints, arm), tasks, limit, tmp_path / f"{arm}.json", device="cpu")
        remote = ",trust_remote_code=True" if arm == "prism" else ""
        theirs = lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={exports / arm}{remote}",
            tasks=tasks,
            limit=limit,
            num_fewshot=0,
            task_manager=task_manager("offline"),
            device="cpu",
            batch_size=8,
        )
        for task in tasks:
            for metric in ("acc", "acc_norm"):
                print(arm, task, metric, ours["tasks"][task][metric], theirs["results"][task][f"{metric},none"])
                assert theirs["results"][task][f"{metric},none"] == ours["tasks"][task][metric], (arm, task, metric)


def test_init_from_starts_a_run_at_the_exported_weights(exports, tiny_checkpoints, tmp_path):
    """A 1-step run from the export at a negligible lr: its checkpoint has the source's logits."""
    overrides = [*tiny_checkpoints.overrides, "train.train_tokens=1024", "train.lr=1e-12", "train.min_lr=0"]
    result = prism(
        "train",
        "configs/tiny_prism.yaml",
        *overrides,
        f"run.output_dir={tmp_path}",
        f"train.init_from={exports / 'prism'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    tokens = torch.randint(0, 8192, (2, 128), generator=torch.Generator().manual_seed(0))
    source = trainer_logits(tiny_checkpoints.prism, tokens)
    started = trainer_logits(tmp_path / "prism-tiny-s1234" / "checkpoints", tokens)
    assert ((started - source).abs().max() / source.abs().max()).item() <= 1e-6

    wrong = prism("train", "configs/tiny_prism.yaml", *overrides, f"run.output_dir={tmp_path / 'wrong'}",
                  f"train.init_from={exports / 'uniform'}")  # fmt: skip
    assert "schedule.heads" in error_line(wrong, "train")


def test_bad_input_is_one_line_and_writes_nothing(exports, tiny_checkpoints, tmp_path):
    # --out exists and is not empty
    assert "--force" in error_line(
        prism("export", str(tiny_checkpoints.uniform), "--out", str(exports / "prism")), "export"
    )
    assert (exports / "prism" / "modeling_prism.py").is_file()  # untouched
    # no checkpoint in the run
    (tmp_path / "empty-run").mkdir()
    error_line(prism("export", str(tmp_path / "empty-run"), "--out", str(tmp_path / "a")), "export")
    # a tag with a missing file
    tag = tmp_path / "tag"
    shutil.copytree(tiny_checkpoints.uniform / "step-0000002", tag)
    (tag / "mp_rank_00_model_states.pt").unlink()
    assert "missing" in error_line(prism("export", str(tag), "--out", str(tmp_path / "b")), "export")
    # a tag whose bytes no longer match its integrity record
    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoints.uniform / "step-0000002", bad)
    states = bad / "mp_rank_00_model_states.pt"
    flipped = bytearray(states.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    states.write_bytes(bytes(flipped))
    assert "sha256" in error_line(prism("export", str(bad), "--out", str(tmp_path / "d")), "export")
    # the tokenizer gone (neither the configured file nor the dataset manifest's)
    gone = [f"data.tokenizer={tmp_path / 'gone.json'}", f"data.dataset_dir={tmp_path / 'gone'}"]
    line = error_line(prism("export", str(tiny_checkpoints.uniform), *gone, "--out", str(tmp_path / "c")), "export")
    assert "data.tokenizer" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "empty-run", "tag"]  # nothing half-written


def val_loss_of_export(folder: Path, tag_dir: Path) -> float:
    """Mean next-token loss of an exported model over the run's fixed val rows (what the trainer logs)."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from pipeline import data
    from pipeline.inference import load_config

    cfg = load_config(tag_dir)
    rows = torch.from_numpy(data.load_val_tokens(cfg, data.read_manifest(cfg.data.dataset_dir)).astype("int64"))
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(rows[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).item()


def test_tp2_checkpoint_exports_whole(tiny_checkpoints, tmp_path):
    """A TP=2, ZeRO-2 run whose 3-head layers run replicated: the gathered export scores the val set as the
    TP=2 trainer did at its last step; a missing rank is one line."""
    from pipeline.checkpoint import resolve_tag_dir
    from pipeline.export.hf import run_facts

    overrides = [*tiny_checkpoints.overrides, f"run.output_dir={tmp_path}", "parallel.tp=2", "parallel.zero_stage=2"]
    overrides += ["parallel.replicate_indivisible_layers=true"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1"]
    train = [*torchrun, "-m", "pipeline.cli", "train", "configs/tiny_prism.yaml", *overrides]
    result = subprocess.run(train, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    tag = resolve_tag_dir(tmp_path / "prism-tiny-s1234")
    assert (tag / "mp_rank_01_model_states.pt").is_file()
    exported = prism("export", str(tag), "--out", str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr[-3000:]
    logged = run_facts(tag)["val_loss"]
    got = val_loss_of_export(tmp_path / "hf", tag)
    print(f"TP=2: trainer val loss {logged:.6f}, export {got:.6f}")
    assert got == pytest.approx(logged, rel=1e-5)
    # prism eval loads the same TP=2 checkpoint into one process (the ranks' weights joined): the trainer's
    # loss on the val rows again, and --milestones scores the run's milestone at this TP size too
    from pipeline import data
    from pipeline.inference import load_checkpoint
    from pipeline.model import lm_loss

    cfg, model, _ = load_checkpoint(tag, device="cpu")
    rows = data.load_val_tokens(cfg, data.read_manifest(cfg.data.dataset_dir)).astype("int64")
    with torch.no_grad():
        assert lm_loss(model, torch.from_numpy(rows)).item() == pytest.approx(logged, rel=1e-5)
    scored = prism("eval", str(tag.parent.parent), "--milestones", "--tasks", "piqa", "--limit", "4")
    assert scored.returncode == 0 and "scored 1 milestone(s) (steps 2)" in scored.stdout, scored.stderr[-3000:]

    (tag / "mp_rank_01_model_states.pt").unlink()
    assert "mp_rank_01" in error_line(prism("export", str(tag), "--out", str(tmp_path / "hf2")), "export")
    assert not (tmp_path / "hf2").exists()


def test_broken_out_and_broken_exports_are_one_line(exports, tiny_checkpoints, tmp_path):
    # --out under a regular file: was FileExistsError from mkdir
    (tmp_path / "notes.txt").write_text("a file, not a folder\n")
    line = error_line(
        prism("export", str(tiny_checkpoints.uniform), "--out", str(tmp_path / "notes.txt" / "hf")), "export"
    )
    assert "notes.txt is a file" in line
    assert (tmp_path / "notes.txt").read_text() == "a file, not a folder\n"
    # an export whose config.json was cut short: was JSONDecodeError
    truncated = tmp_path / "truncated"
    shutil.copytree(exports / "uniform", truncated)
    text = (truncated / "config.json").read_text()
    (truncated / "config.json").write_text(text[: len(text) // 2])
    assert "not valid JSON" in error_line(prism("generate", str(truncated), "--prompt", "The"), "generate")
    # an export without its weights: was OSError from from_pretrained
    no_weights = tmp_path / "no-weights"
    shutil.copytree(exports / "prism", no_weights)
    for f in no_weights.glob("*.safetensors*"):
        f.unlink()
    assert "cannot load the export" in error_line(prism("generate", str(no_weights), "--prompt", "The"), "generate")
