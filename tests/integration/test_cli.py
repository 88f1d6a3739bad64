"""The `prism` command line: the verbs it offers, that its help stays import-light, `schedule validate CONFIG`."""

import json
import subprocess
import sys

VERBS = [
    "schedule",
    "model",
    "plan",
    "prepare",
    "train",
    "profile",
    "cooldown",
    "tracking",
    "compare",
    "scaling",
    "eval",
    "export",
    "generate",
    "attention-distance",
    "sweep",
    "search",
    "study",
    "demo",
]
HEAVY = ("torch", "megatron", "deepspeed", "mlflow", "datatrove", "lm_eval", "transformers")


def prism(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, timeout=300)


def test_help_lists_exactly_the_verbs():
    out = prism("--help")
    assert out.returncode == 0, out.stderr
    listed = out.stdout.split("positional arguments:")[1].split("options:")[0]
    # a verb's line starts at 4 spaces; wrapped help text is indented further
    verbs = [line.split()[0] for line in listed.splitlines() if line.startswith("    ") and line[4] != " "]
    assert verbs == VERBS
    for verb in VERBS:
        assert prism(verb, "--help").returncode == 0, verb


def test_parser_imports_no_heavy_library():
    code = (
        "import json, sys\n"
        "from pipeline.cli import build_parser\n"
        "build_parser()\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({list(HEAVY)!r}))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_schedule_validate_config():
    ok = prism("schedule", "validate", "configs/prism_124m.yaml")
    assert ok.returncode == 0, ok.stderr
    first, header, *rows = ok.stdout.strip().splitlines()
    assert first == "schedule 3x2,6x2,8x2,12x6 is valid for d_model=768, 12 layers, h_base=12, TP=1"
    assert header.split()[:3] == ["layer", "heads", "d_h"]
    assert [tuple(int(x) for x in r.split()[:3]) for r in rows] == [
        (i + 1, h, 768 // h) for i, h in enumerate((3, 3, 6, 6, 8, 8, 12, 12, 12, 12, 12, 12))
    ]
    # an override that breaks a rule (3 heads do not split over TP=2): one line, exit 2, no traceback
    bad = prism("schedule", "validate", "configs/prism_124m.yaml", "parallel.tp=2")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("prism schedule: error: ")
    assert "tensor-parallel" in bad.stderr and "layer(s) 1, 2" in bad.stderr


def test_cli_train_refuses_transformer_engine_on_cpu_with_exit_2(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "train", "configs/tiny_prism.yaml", "model.spec=transformer_engine"]
        + ["train.device=cpu", f"run.output_dir={tmp_path}", "tracking.enabled=false"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr
    assert "model.spec: transformer_engine needs a CUDA device" in out.stderr
    assert "Traceback" not in out.stderr and not list(tmp_path.rglob("*.pt"))
