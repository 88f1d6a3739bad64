"""The docs against the code, in-process: the configuration reference is what `make docs` renders from the schema
and covers every key a config has; every link between README.md and docs/ resolves; every shell block is tagged
by the convention (docs/README.md) and every command of a block the suite does not run parses. The blocks it
runs are tests/integration/test_docs_run.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.cli import docs
from tests.docs_blocks import SHELL_KINDS, check_command, commands, doc_blocks

ROOT = docs.ROOT
CONFIG_MD = ROOT / "docs" / "config.md"
# Fence info strings a doc may use: the shell kinds, output, and code the suite does not run.
OTHER_KINDS = ("text", "python", "yaml", "")
FIX = "run `make docs` and commit docs/config.md"


def region(text: str, name: str) -> str:
    found = [m.group("body") for m in docs.REGION.finditer(text) if m.group("name") == name]
    assert len(found) == 1, f"one region {name!r} expected, found {len(found)}"
    return found[0]


def test_config_reference_is_what_make_docs_renders():
    assert region(CONFIG_MD.read_text(), "config-keys") == docs.config_keys(), (
        f"docs/config.md is out of date with the schema in pipeline/config/: {FIX}"
    )


@pytest.mark.parametrize("name", [n for n in docs.SOURCE_REGIONS if n != "config-keys"])
def test_regions_rendered_from_the_source_are_current(name):
    """The regions `make docs` renders from the code alone (the command transcripts are rerun by
    tests/integration/test_docs_run.py instead)."""
    holders = [p for p in docs.doc_paths() if f"make docs: {name} -->" in p.read_text()]
    assert holders, f"no doc holds the region {name!r}"
    for path in holders:
        assert region(path.read_text(), name) == docs.REGIONS[name](), (
            f"{path.relative_to(ROOT)}: region {name!r} is out of date with the code: run `make docs` and commit it"
        )


def test_import_graph_sees_function_level_imports_and_circles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert docs.cycles(edges) == [{"a", "b", "c"}]
    assert docs.cycles({"a": {"b"}, "b": set()}) == []
    graph = docs.import_graph()
    assert "| `pipeline.cli` |" in graph and "`pipeline.train`" in graph.split("| `pipeline.cli` |")[1].split("\n")[0]


POLICIES = {"pipeline.demo", "pipeline.study", "pipeline.sweep", "pipeline.search"}


def test_the_layers_read_top_down():
    """Verbs, then the policies, then pipeline.runs, then the core; launchers' job-side helpers sit beside the
    verbs. An import against that order, or a circle between modules, fails here, whatever the generated table
    says. Circles are judged between modules, not units: pipeline.config reads the task names of
    pipeline.eval.catalog, a leaf, while other eval modules read the config."""
    edges = docs.unit_edges()
    assert POLICIES | {"pipeline.runs", "pipeline.cli", "launchers"} <= set(edges)
    modules = docs.module_edges()
    assert {"pipeline.config", "pipeline.config.schema", "pipeline.checkpoint.restore"} <= set(modules)
    assert "pipeline.config.schema" in modules["pipeline.config.loading"]  # a submodule, not the package
    assert docs.cycles(modules) == [], "a circle between modules (a package's __init__ and its submodules count)"
    for unit, targets in edges.items():
        if unit.startswith("pipeline"):
            assert "launchers" not in targets, f"{unit} imports launchers: job-side scripts sit above pipeline"
        if unit != "pipeline.cli":
            assert "pipeline.cli" not in targets, f"{unit} imports the verbs"
        if unit not in POLICIES | {"pipeline.cli", "launchers"}:
            assert not targets & POLICIES, f"{unit} imports a policy: {sorted(targets & POLICIES)}"
        if unit not in POLICIES | {"pipeline.cli", "launchers", "pipeline.runs"}:
            assert "pipeline.runs" not in targets, f"{unit} imports pipeline.runs, a layer above it"


def _resolve(name: str, context: list[object]) -> object | None:
    """The object a doc's `name` denotes: `model/tp_layout.tp_split`, `pipeline/exit_codes.py`,
    `checkpoint.tag_names`, `Config.run_name`, `cfg.layer_plan`, or a bare name from a module named earlier in
    the same cell (``context``); None when nothing of that name exists."""
    import importlib

    from pipeline.config import Config

    name = re.sub(r"\(.*\)$", "", name)
    if name.endswith(".py"):
        return next((p for p in (ROOT / name, ROOT / "pipeline" / name) if p.is_file()), None)
    folder, _, dotted = name.rpartition("/")
    parts = (folder.replace("/", ".") + "." + dotted if folder else dotted).split(".")
    if parts[0] == "cfg":
        parts[0] = "Config"
    for start in ([], ["pipeline"], ["pipeline", "config"]):
        full = start + parts
        for cut in range(len(full), 0, -1):
            try:
                obj: object = importlib.import_module(".".join(full[:cut]))
            except ImportError:
                continue
            for attr in full[cut:]:
                obj = getattr(obj, attr, None) if obj is not None else None
            if obj is not None:
                return obj
            break
    if parts[0] == "Config":
        obj = Config
        for attr in parts[1:]:
            obj = getattr(obj, attr, None) or getattr(obj, "__dataclass_fields__", {}).get(attr)
        return obj
    return next((getattr(c, name) for c in reversed(context) if hasattr(c, name)), None)


def test_every_owner_the_architecture_names_exists():
    """The owners table names real code: each `name` in its owner column is a module, function, class,
    constant or file of this checkout, or a config key or manifest field the source spells out. A rename
    that leaves the table behind fails here."""
    import inspect

    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("\n## Owners\n", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| decision")]
    assert len(rows) >= 15, "the owners table went missing"
    source = "".join(p.read_text() for root in ("pipeline", "data_prep") for p in (ROOT / root).rglob("*.py"))
    missing = []
    for row in rows:
        decision, owner = (cell.strip() for cell in row.strip("|").split("|")[:2])
        context: list[object] = []
        for name in re.findall(r"`([^`]+)`", owner):
            found = _resolve(name, context)
            if found is None and re.fullmatch(r"[a-z_]+(\.[a-z_]+)+", name) and f'"{name}' in source.replace("'", '"'):
                continue  # a config key or manifest field, spelled as such in the source
            if found is None:
                missing.append(f"{decision[:40]!r}: `{name}`")
                continue
            module = found if inspect.ismodule(found) else inspect.getmodule(found)
            owner_class = getattr(module, getattr(found, "__qualname__", "").partition(".")[0], None)
            context += [c for c in (module, owner_class, found) if c is not None]
    assert not missing, f"docs/architecture.md names owners the code does not have: {missing}"


def test_config_reference_lists_every_key_a_config_has():
    """Independent of the generator: the keys a loaded preset dumps, and every key the rule tables name."""
    from pipeline import config
    from pipeline.config.resume_keys import EXECUTION_ONLY_KEYS, MODEL_OR_DATA_KEYS, RECIPE_KEYS, flatten
    from pipeline.config.rules import NAME_KEYS, NON_EMPTY_KEYS, RANGES

    documented = set(re.findall(r"^\| `([\w.<>]+)` \|", region(CONFIG_MD.read_text(), "config-keys"), re.M))
    dumped = set(flatten(config.load(ROOT / "configs" / "tiny_prism.yaml").to_dict()))
    # a mapping of sections (data.val_sets): the mapping, and its entries' keys under <name>
    dumped = {re.sub(r"^data\.val_sets\.[^.]+\.", "data.val_sets.<name>.", k) for k in dumped} | {"data.val_sets"}
    assert documented == dumped, (
        f"not in docs/config.md: {sorted(dumped - documented)}; no such key: {sorted(documented - dumped)}; {FIX}"
    )
    named = {k.removesuffix("[]").replace("{}.", ".<name>.") for k in RANGES} | {
        *NON_EMPTY_KEYS,
        *NAME_KEYS,
        *RECIPE_KEYS,
    }
    assert named <= documented, f"rule tables name keys the reference lacks: {sorted(named - documented)}"
    for prefix in (*MODEL_OR_DATA_KEYS, *EXECUTION_ONLY_KEYS):
        assert any(k == prefix or k.startswith(prefix + ".") for k in documented), prefix


def test_resume_column_says_what_the_resume_policy_does():
    text = region(CONFIG_MD.read_text(), "config-keys")
    resume = dict(re.findall(r"^\| `([\w.]+)` \|(?:[^|]*\|){3}([^|]*)\|", text, re.M))
    assert resume["model.d_model"].strip() == "never"
    assert resume["train.lr"].strip() == "with `checkpoint.allow_changes`"
    assert resume["data.tasks"].strip() == "yes"  # execution only, although under data
    assert resume["train.log_every"].strip() == "yes"


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to '-', repeats numbered."""
    out: set[str] = set()
    fence = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"#{1,6} (.+)", line)):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = sum(1 for a in out if a == slug or re.fullmatch(re.escape(slug) + r"-\d+", a))
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[str]:
    text = re.sub(r"^\s*```.*?^\s*```", "", path.read_text(), flags=re.S | re.M)  # not inside code blocks
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


def test_links_between_readme_and_docs_resolve():
    broken = []
    for path in docs.doc_paths():
        for target in links(path):
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading in {dest.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_anchor_rules_match_github():
    assert anchors(
        "## Writing these docs: the rules the tests enforce\n## prism export, prism generate\n## A\n## A"
    ) == {
        "writing-these-docs-the-rules-the-tests-enforce",
        "prism-export-prism-generate",
        "a",
        "a-1",
    }


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move reference material into docs/"
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[:2] == ["## Two commands", "## A real run on a Slurm cluster"], headings


def test_every_block_is_tagged_by_the_convention():
    wrong = [
        f"{b.where()}: ```{b.info}"
        for b in doc_blocks()
        if b.info not in SHELL_KINDS and b.info not in OTHER_KINDS or b.info == "" and commands(b.body)[:1]
    ]
    assert not wrong, f"use ```sh, ```sh cluster or ```sh long for commands (docs/README.md): {wrong}"


SHELL_COMMANDS = [
    pytest.param(command, id=f"{b.where()}:{i}")
    for b in doc_blocks()
    if b.info in SHELL_KINDS
    for i, command in enumerate(commands(b.body))
]


@pytest.mark.parametrize("command", SHELL_COMMANDS)
def test_documented_command_parses(command):
    assert check_command(command) is None, f"{command}\n-> {check_command(command)}"


def test_python_blocks_compile():
    for b in doc_blocks():
        if b.info == "python":
            compile(b.body, b.where(), "exec")


@pytest.mark.parametrize(
    "command, why",
    [
        ("prism plan configs/prism_757m.yaml --node 2", "unrecognized arguments: --node"),  # abbreviation
        ("prism export $RUN_DIR --output x", "unrecognized arguments: --output"),
        ("prism prepare configs/prism_757m.yaml data.slurm.partiton=cpu", "data.slurm.partiton: unknown key"),
        ('PRISM_OVERRIDES="train.lrr=1" sbatch launchers/prism_757m.sbatch', "train.lrr: unknown key"),
        ("sbatch launchers/prism_2b.sbatch", "does not exist"),
        ("make dmeo", "'dmeo' is not in the Makefile"),
        ("python benchmarks/bench_arms.py --scales 124m", "no flag --scales"),
        ("prism study configs/tiny_prism.yaml configs/nope.yaml --seeds 2", "configs/nope.yaml does not exist"),
        ("frobnicate --all", "unknown command"),
    ],
)
def test_a_broken_command_is_caught(command, why):
    assert why in (check_command(command) or "")


def test_blocks_and_their_output(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text(
        "```sh\nprism plan a.yaml \\\n  --nodes 2   # two\n\n# note\nls\n```\n\n```text\nplan: x\n```\n\n"
        "```sh cluster\nsbatch x\n```\nprose\n```text\nnot its output\n```\n"
        "  ```sh\n  indented\n  ```\n"
    )
    first, second, third = [b for b in doc_blocks([doc]) if b.info in SHELL_KINDS]
    assert (first.info, commands(first.body), first.output) == (
        "sh",
        ["prism plan a.yaml --nodes 2", "ls"],
        "plan: x\n",
    )
    assert (second.info, second.output) == ("sh cluster", None)
    assert (third.body, third.line) == ("indented\n", 20)


def test_no_test_module_name_is_in_both_suites():
    """The compat leg collects tests/unit and tests/integration in one pytest session, where two test modules
    of one name (the suites are not packages) fail collection with 'import file mismatch'."""
    unit = {p.name for p in (ROOT / "tests" / "unit").glob("test_*.py")}
    integration = {p.name for p in (ROOT / "tests" / "integration").glob("test_*.py")}
    assert not unit & integration, f"rename one of each: {sorted(unit & integration)}"
