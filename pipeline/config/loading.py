"""Loading a config: YAML presets with `base:` overlays (`read_yaml`, found by `find_preset`), dotted overrides,
the `{output_dir}` expansion of path keys, the type coercer that checks every value against the schema's
annotations, and `load` / `from_dict`, which build (and so validate) a Config. Around a loaded one:
`relocate` (the overrides that move a run to another folder, its data staying put) and `changed_keys` (what
a resume compares)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from pipeline.config.errors import ConfigError
from pipeline.config.resume_keys import MODEL_OR_DATA_KEYS, flatten, in_scope, with_compact_schedule
from pipeline.config.schema import REQUIRED, Config, DataConfig, RunConfig, schema_default


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:  # YAML writes it as a list
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if typing.get_origin(tp) is dict:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats (3e-4 vs 1)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping (section), got {type(value).__name__}")
        return _build(tp, value, where)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not allowed; choose one of {_type_name(tp)}")
        return value
    if isinstance(tp, types.UnionType) or origin is typing.Union:
        for option in typing.get_args(tp):
            try:
                return _coerce(value, option, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: {value!r} has the wrong type; expected {_type_name(tp)}")
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{where}: expected null")
        return None
    if origin is tuple:  # a YAML list, kept as a tuple so the loaded config stays immutable
        item = typing.get_args(tp)[0]
        if not isinstance(value, list | tuple):
            spelled = f"[{value}]" if isinstance(value, str | int | float) else "[a, b]"
            raise ConfigError(f"{where}: expected a list of {_type_name(item)}, got {value!r}; write it as {spelled}")
        return tuple(_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        item = typing.get_args(tp)[1]
        if item is str:  # sbatch_args: flags and values as the shell sees them
            return {str(k): str(v) for k, v in value.items()}
        return {str(k): _coerce(v, item, f"{where}.{k}") for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "3e-4" as a string
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ConfigError(f"{where}: {value!r} has the wrong type; expected {_type_name(tp)}")
    return value


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    return cls(**_section_kwargs(cls, data, where))


def _section_kwargs(cls: type, data: dict[str, Any], where: str) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name != "source"}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key; allowed keys here: {', '.join(fields)}".lstrip("."))
    kwargs = {}
    for name, f in fields.items():
        key = f"{where}.{name}" if where else name
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], key)
        elif f.default is REQUIRED and f.default_factory is REQUIRED:  # type: ignore[misc]
            raise ConfigError(f"{key}: missing required key ({_type_name(hints[name])})")
    return kwargs


def override_list(overrides: dict[str, Any] | list[str] | None) -> list[str]:
    """A spec file's ``overrides`` (a mapping {dotted.key: value} or a list of 'dotted.key=value') as the
    list load() takes: what the sweep and the search specs both accept."""
    if not overrides:
        return []
    if isinstance(overrides, dict):
        return [f"{k}={json.dumps(v) if isinstance(v, list | dict) else v}" for k, v in overrides.items()]
    return [str(o) for o in overrides]


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r}: write it as section.key=value, e.g. train.lr=3e-4")
    key, _, raw = text.partition("=")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    data = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {part} is not a section")
        node[path[-1]] = value
    return data


def from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    """Build and validate (Config.__post_init__) a config from YAML-shaped data."""
    try:
        sections = _section_kwargs(Config, data, "")
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return Config(**sections, source=source)


def load(path: str | Path, overrides: list[str] | None = None) -> Config:
    """A YAML preset (its `base:` chain merged under it), then the dotted overrides, validated."""
    return from_dict(expand_output_dir(apply_overrides(read_yaml(path), overrides or [])), str(path))


# Path keys that may start with {output_dir}: they follow run.output_dir (`prism demo run.output_dir=/tmp/x`
# puts the data there too), expanded once on load, after the overrides.
OUTPUT_DIR_KEYS = (("data", "dataset_dir"), ("data", "input"), ("data", "tokenizer"), ("checkpoint", "dir"))


def expand_output_dir(data: dict[str, Any]) -> dict[str, Any]:
    out_dir = str((data.get("run") or {}).get("output_dir") or RunConfig.output_dir)
    data = copy.deepcopy(data)
    val_sets = (data.get("data") or {}).get("val_sets")
    places = [(data.get(section), key) for section, key in OUTPUT_DIR_KEYS]
    if isinstance(val_sets, dict):  # each set's folder and input, like data.dataset_dir and data.input
        places += [(spec, key) for spec in val_sets.values() for key in ("dataset_dir", "input")]
    for node, key in places:
        value = node.get(key) if isinstance(node, dict) else None
        if isinstance(value, str) and "{output_dir}" in value:
            node[key] = value.replace("{output_dir}", out_dir)
    return data


def relocate(cfg: Config, output_dir: str | Path) -> list[str]:
    """The overrides that move a loaded run to ``output_dir`` (a search trial's folder, a schedule's, the same
    folder spelled absolute for a job that starts in another directory) and keep its data where the data is.
    Its data paths, `{output_dir}` ones included, were expanded on load against the folder it had; here each
    local one becomes absolute (from this directory), so neither the move nor the job's cwd moves it:
    data.dataset_dir, data.tokenizer, data.input and each of data.val_sets' dataset_dir and input."""
    d = cfg.data
    paths = {"data.dataset_dir": d.dataset_dir, "data.tokenizer": d.tokenizer, "data.input": d.input}
    for name, spec in d.val_sets.items():
        paths[f"data.val_sets.{name}.dataset_dir"] = spec.dataset_dir
        if spec.input is not None:
            paths[f"data.val_sets.{name}.input"] = spec.input
    pinned = [f"run.output_dir={_absolute(output_dir)}"]
    for key, value in paths.items():
        pinned.append(f"{key}={_absolute(value) if _is_local(key, value, d) else value}")
    return pinned


def _absolute(path: str | Path) -> str:
    """Absolute from this directory, symlinks kept as spelled (a linked data folder keeps its name)."""
    return os.path.abspath(Path(path).expanduser())


def _is_local(key: str, value: str, data: DataConfig) -> bool:
    """Whether a data path names a file or folder here; else a Hub name or a URL, the same from anywhere. A
    dataset folder, a tokenizer .json and an embedded corpus are files even before `prism prepare` makes them."""
    if "://" in value:
        return False
    embedded_input = key.endswith("input") and data.input_format == "embedded"
    return key.endswith("dataset_dir") or value.endswith(".json") or embedded_input or Path(value).exists()


# The project's own presets: where a `base:` is looked for when it is not next to the file (a copied preset).
PROJECT_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def preset_name(arm: str, scale: str) -> str:
    """The file of an arm at a scale: <arm>_<scale>.yaml; the CPU presets are named tiny_<arm>.yaml."""
    return f"tiny_{arm}.yaml" if scale == "tiny" else f"{arm}_{scale}.yaml"


def find_preset(text: str | Path, *near: Path) -> Path | None:
    """The one way a preset is looked up (sweep, search, demo): TEXT as a path relative to each folder of
    NEAR, then to the cwd, then to the project; else a name under the project's configs/ (``prism_124m`` or
    ``prism_124m.yaml``). None when no candidate is a file."""
    text = str(text)
    places = [Path(folder) / text for folder in near] + [Path(text), PROJECT_CONFIGS.parent / text]
    places += [PROJECT_CONFIGS / text, PROJECT_CONFIGS / f"{text}.yaml"]
    return next((p.resolve() for p in places if p.is_file()), None)


def read_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A preset as one mapping: a top-level `base: FILE` is read first and this file's keys are deep-merged
    over it, so an arm overlay names only what differs from its scale's base. FILE is looked for next to this
    file, then in the project's configs/ (so a preset copied anywhere still finds base/tiny.yaml)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found; pass a YAML preset such as configs/tiny_prism.yaml")
    if path.resolve() in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path.resolve()))
        raise ConfigError(f"{path}: base files form a cycle ({chain}); remove one base: key")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    if "base" not in data:
        return data
    base = data.pop("base")
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base: {base!r} must be a file name, e.g. base: base/124m.yaml")
    places = [path.parent / base, PROJECT_CONFIGS / base]
    found = next((p for p in places if p.is_file()), None)
    if found is None:
        raise ConfigError(
            f"{path}: base {base}: config file not found in {path.parent} or {PROJECT_CONFIGS}; "
            "put it next to the preset or name a file under configs/"
        )
    return _deep_merge(read_yaml(found, (*_seen, path.resolve())), data)


def _deep_merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """Mappings merge key by key; anything else (a value, a list) in the overlay replaces the base's."""
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def changed_keys(old: dict[str, Any], new: dict[str, Any], scope: tuple[str, ...] = MODEL_OR_DATA_KEYS) -> list[str]:
    """Flattened keys under ``scope`` whose values differ between two config dicts. The schedule is compared
    as what it builds: a config saved before schedules were stored compactly may spell it another way."""
    a, b = with_compact_schedule(flatten(old)), with_compact_schedule(flatten(new))
    keys = sorted(set(a) | set(b))

    def differs(k: str) -> bool:
        if k not in a:  # saved before the key existed: that run had the default's behaviour
            return b.get(k) != schema_default(k)
        return a.get(k) != b.get(k)

    return [k for k in keys if in_scope(k, scope) and differs(k)]
