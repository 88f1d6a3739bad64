"""A YAML spec (a sweep's, a search's) read with the line and column of every value, and the ``slurm:`` section
both share: a bad field is one line saying where it is (``spec.yaml:7:10: slurm.nodes=0: must be a positive
integer``), never a traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config import ConfigError

SLURM_INT_KEYS = (
    "nodes",
    "gpus_per_node",
    "cpus_per_task",
    "timeout_min",
    "signal_delay_s",
    "max_num_timeout",
)
SLURM_KEYS = (*SLURM_INT_KEYS, "partition", "additional_parameters")


class SpecFile:
    """A YAML spec (a sweep's, a search's) read with the line and column of every value, so that a bad field
    is one line saying where it is: ``spec.yaml:7:10: slurm.nodes=0: must be a positive integer``."""

    def __init__(self, path: str | Path, kind: str, keys: tuple[str, ...]):
        import yaml

        self.path, self.kind = Path(path), kind
        if not self.path.is_file():
            raise ConfigError(f"{self.path}: {kind} not found")
        try:
            text = self.path.read_text()
            data = yaml.safe_load(text) or {}
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
            what = getattr(e, "problem", None) or type(e).__name__
            raise ConfigError(f"{self.path}: not valid YAML{at}: {what}; fix the syntax there") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{self.path}: cannot read the {kind}: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{self.path}: a {kind} is a mapping of {', '.join(keys)}; got {type(data).__name__}")
        self.data: dict[str, Any] = data
        self.marks: dict[str, tuple[int, int]] = {}  # dotted key -> (line, column) of its value, 1-based
        self._mark(root, "")
        unknown = sorted(str(k) for k in data if k not in keys)
        if unknown:
            raise self.error(unknown[0], f"unknown key {unknown[0]!r}; allowed: {', '.join(sorted(keys))}", at_key=True)

    def _mark(self, node: Any, prefix: str) -> None:
        import yaml

        if not isinstance(node, yaml.MappingNode):
            return
        for key_node, value_node in node.value:
            dotted = f"{prefix}{key_node.value}"
            self.marks[dotted] = (value_node.start_mark.line + 1, value_node.start_mark.column + 1)
            self.marks[f"{dotted} (key)"] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            self._mark(value_node, f"{dotted}.")

    def value(self, key: str) -> Any:
        """The value at a dotted key (``slurm.nodes``), None where it is absent."""
        node: Any = self.data
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    def error(self, key: str, message: str, at_key: bool = False) -> ConfigError:
        """``PATH:LINE:COL: message``, at the key's value (or at the key itself), the closest known place."""
        probe = key
        while probe and f"{probe} (key)" not in self.marks:
            probe = probe.rpartition(".")[0]
        line, col = self.marks.get(f"{probe} (key)" if at_key else probe, (0, 0)) if probe else (0, 0)
        at = f":{line}:{col}" if line else ""
        return ConfigError(f"{self.path}{at}: {message}")

    def bad(self, key: str, want: str) -> ConfigError:
        """``PATH:LINE:COL: key=value: what is wanted``."""
        return self.error(key, f"{key}={self.value(key)!r}: {want}")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def mapping_section(spec: SpecFile, name: str, keys: tuple[str, ...]) -> dict[str, Any] | None:
    """A spec's optional ``name:`` section: None when absent, else a mapping holding only ``keys`` (refused in
    one line naming the first other key)."""
    section = spec.data.get(name)
    if section is None:
        return None
    if not isinstance(section, dict):
        raise spec.bad(name, f"must be a mapping of {', '.join(keys)}")
    unknown = sorted(str(k) for k in section if k not in keys)
    if unknown:
        raise spec.error(
            f"{name}.{unknown[0]}", f"unknown key {name}.{unknown[0]}; allowed: {', '.join(keys)}", at_key=True
        )
    return section


def check_slurm_section(spec: SpecFile) -> None:
    """The ``slurm:`` mapping of a spec: make_executor's settings, each checked (sweeps and searches)."""
    slurm = mapping_section(spec, "slurm", SLURM_KEYS)
    if slurm is None:
        return
    for key in SLURM_INT_KEYS:
        if key in slurm and not (is_int(slurm[key]) and slurm[key] >= (0 if key == "gpus_per_node" else 1)):
            raise spec.bad(f"slurm.{key}", "must be a positive integer")
    if "partition" in slurm and not isinstance(slurm["partition"], str):
        raise spec.bad("slurm.partition", "must be a partition name")
    if "additional_parameters" in slurm and not isinstance(slurm["additional_parameters"], dict):
        raise spec.bad("slurm.additional_parameters", "must be a mapping of sbatch options")
