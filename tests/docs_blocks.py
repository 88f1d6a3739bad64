"""The shell blocks of README.md and docs/*.md, and the checks the docs tests apply to them.

The convention (stated for writers in docs/README.md, "Writing these docs"):
- ```sh          runs on a CPU machine: tests/integration/test_docs_run.py runs it with `bash -e` and asserts exit 0;
- ```sh cluster  needs a Slurm cluster or a GPU, ```sh long takes minutes on a CPU (`make demo`): not run, each
                 command is checked to parse (`check_command`; tests/unit/test_docs.py);
- a ```text block right after a ```sh block is its output: each of its lines (but `...`) must be found in a line
  the block printed.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from pipeline.cli.docs import ROOT, doc_paths

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^`\n]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
SHELL_KINDS = ("sh", "sh cluster", "sh long")  # run on CPU; needs a cluster or GPU; minutes on CPU


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    info: str  # the fence's info string: "sh", "sh cluster", "text", "python", ...
    body: str
    output: str | None = None  # a ```text block right after a ```sh block: what it prints

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_blocks(paths: list[Path] | None = None) -> list[Block]:
    """Every fenced block of the docs, with a shell block's shown output attached to it."""
    blocks: list[Block] = []
    for path in paths or doc_paths():
        text = path.read_text()
        found = list(FENCE.finditer(text))
        for i, m in enumerate(found):
            info = " ".join(m.group("info").split())
            nxt = found[i + 1] if i + 1 < len(found) else None
            output = None
            if info.startswith("sh") and nxt and nxt.group("info").strip() == "text":
                if not text[m.end() : nxt.start()].strip():  # nothing but blank lines between them
                    output = textwrap.dedent(nxt.group("body"))
            body = textwrap.dedent(m.group("body"))
            blocks.append(Block(path, text.count("\n", 0, m.start()) + 1, info, body, output))
    return blocks


def commands(body: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments and blank lines dropped."""
    out, pending = [], ""
    for raw in body.splitlines():
        line = pending + raw.lstrip() if pending else raw
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1].rstrip() + " "
            continue
        pending = ""
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            out.append(line)
    return out


# Commands that are not ours: their flags can't be checked here, only that the docs name them on purpose.
EXTERNAL = {
    "scancel",
    "squeue",
    "sacct",
    "scontrol",
    "mlflow",
    "optuna-dashboard",
    "pip",
    "git",
    "cd",
    "export",
    "mkdir",
    "umask",
    "openssl",
}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def check_command(command: str) -> str | None:
    """Why ``command`` would not run as documented (None: it parses). No command is executed: `prism` lines
    go through the verb's own parser (and a CONFIG is loaded with its overrides), scripts and files must
    exist, `make` targets must be defined."""
    try:
        argv = shlex.split(command)
    except ValueError as e:
        return f"not shell syntax ({e})"
    env = {}
    while argv and ASSIGNMENT.match(argv[0]):  # VAR=value before the command
        name, _, value = argv.pop(0).partition("=")
        env[name] = value
    if not argv:
        return None
    word = Path(argv[0]).name if argv[0].endswith("/python") else argv[0]
    if word == "prism":
        return _check_prism(argv[1:])
    if word == "make":
        defined = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))
        missing = [t for t in argv[1:] if not t.startswith("-") and "=" not in t and t not in defined]
        return f"make target {missing[0]!r} is not in the Makefile" if missing else None
    if word == "sbatch":
        return _check_sbatch(next((a for a in reversed(argv[1:]) if not a.startswith("-")), ""), env)
    if word == "bash":
        return _check_file(argv[1] if len(argv) > 1 else "", "bash script")
    if word == "python":
        return _check_python(argv[1:])
    if "/" in word:  # a script of the repository, run by path
        return _check_file(word, "script")
    if word in EXTERNAL:
        return None
    return f"unknown command {word!r}: add it to tests/docs_blocks.py (EXTERNAL, or a check of its own)"


def _check_prism(args: list[str]) -> str | None:
    from pipeline import config
    from pipeline.cli import _all_parsers, build_parser, parse_args

    parser = build_parser()
    for _, verb in _all_parsers(parser._subparsers._group_actions[0]):  # type: ignore[union-attr]
        verb.allow_abbrev = False  # `--node` would pass for `--nodes`: a doc must spell the flag
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns = parse_args(parser, [a for a in args if a != "--verbose"])
    except SystemExit as e:
        if e.code == 0:  # --help, --version
            return None
        return " ".join(err.getvalue().strip().splitlines()[-1:])
    values = [v for v in vars(ns).values() if isinstance(v, str)]
    values += [x for v in vars(ns).values() if isinstance(v, list) for x in v if isinstance(x, str)]
    for value in values:
        if value.endswith((".yaml", ".yml")) and "$" not in value and (problem := _check_file(value, "file")):
            return problem
    overrides = [x for x in getattr(ns, "overrides", None) or getattr(ns, "items", None) or [] if "=" in x]
    configs = [getattr(ns, "config", None)] + [x for x in getattr(ns, "items", None) or [] if "=" not in x]
    for path in [c for c in configs if isinstance(c, str) and c.endswith((".yaml", ".yml"))]:
        try:
            config.load(ROOT / path, overrides)
        except (config.ConfigError, ValueError) as e:
            return f"config does not load: {e}"
    return None


def _check_sbatch(script: str, env: dict[str, str]) -> str | None:
    """The script exists, and the config the job would train (PRISM_CONFIG, else the script's own) loads with
    PRISM_OVERRIDES: a renamed key in a documented job fails here, not on the cluster."""
    from pipeline import config

    if problem := _check_file(script, "sbatch script"):
        return problem
    own = re.search(r"PRISM_CONFIG:-([^}]+)\}", (ROOT / script).read_text())
    preset = env.get("PRISM_CONFIG") or (own.group(1) if own else None)
    if preset is None:
        return f"{script}: no PRISM_CONFIG"
    try:
        config.load(ROOT / preset, shlex.split(env.get("PRISM_OVERRIDES", "")))
    except (config.ConfigError, ValueError, OSError) as e:
        return f"the job's config does not load: {e}"
    return None


def _check_file(path: str, what: str) -> str | None:
    if not path or "$" in path:
        return None if path else f"{what} missing"
    full = ROOT / path
    if not full.is_file():
        return f"{what} {path} does not exist"
    if full.suffix in (".sh", ".sbatch"):
        result = subprocess.run(["bash", "-n", str(full)], capture_output=True, text=True, check=False)
        return f"{path}: {result.stderr.strip()}" if result.returncode else None
    return None


def _check_python(args: list[str]) -> str | None:
    import importlib.util

    if args[:1] == ["-c"]:
        try:
            compile(args[1], "<docs>", "exec")
        except SyntaxError as e:
            return f"python -c: {e}"
        return None
    if args[:1] == ["-m"]:
        if importlib.util.find_spec(args[1]) is None:
            return f"python -m {args[1]}: no such module"
        files = [a for a in args[2:] if a.startswith(("tests/", "benchmarks/"))]
        missing = [f for f in files if not (ROOT / f.split("::")[0]).exists()]
        return f"{missing[0]} does not exist" if missing else None
    script = next((a for a in args if not a.startswith("-")), "")
    if problem := _check_file(script, "python script"):
        return problem
    # its flags, as its --help lists them (the benchmarks parse arguments before importing torch)
    usage = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True, check=False)
    unknown = [a.split("=")[0] for a in args if a.startswith("--") and a.split("=")[0] not in usage.stdout.split()]
    unknown = [a for a in unknown if not re.search(rf"\[?{re.escape(a)}[\] ]", usage.stdout)]
    return f"{script}: no flag {unknown[0]} in its --help" if unknown else None
