"""The one config object: schema, YAML loading (with `base:` overlays), dotted overrides, validation, hash.

Every section is a frozen dataclass; a YAML preset fills it. Loading rejects unknown keys, wrong types, missing
required keys and impossible combinations with one line that names the file, the key and what is allowed.
A loaded Config is valid and immutable. The head schedule is resolved once (a preset name, a list or the
compact form) and judged once by `schedule.judge` with the config's real TP size and replication opt-in:
`schedule_verdict` (violations, allowed warnings, the per-layer plan), `heads_per_layer` and `layer_plan`
are that one answer. The config stores the schedule in its compact form, so its identity (dump, hash) is
what it builds, however it was spelled. Derive a changed config with
`from_dict(apply_overrides(cfg.to_dict(), [...]))`.

This package: `schema` (the sections and the Config object), `errors` (ConfigError, a leaf), `rules` (the
range table and the cross-key rules every Config passes at construction), `resume_keys` (which keys a resume
may change), `loading` (YAML, `base:`, overrides, type coercion, how two configs differ). Submodules import
each other, never this file, so the package has no import circle; `from pipeline import config` gives all of
their public names.
"""

from pipeline.config import rules
from pipeline.config.errors import ConfigError
from pipeline.config.loading import (
    OUTPUT_DIR_KEYS,
    PROJECT_CONFIGS,
    apply_overrides,
    changed_keys,
    expand_output_dir,
    find_preset,
    from_dict,
    load,
    override_list,
    parse_override,
    preset_name,
    read_yaml,
    relocate,
)
from pipeline.config.resume_keys import EXECUTION_ONLY_KEYS, MODEL_OR_DATA_KEYS, RECIPE_KEYS, flatten, result_hash
from pipeline.config.rules import (
    AT_LEAST_1,
    FRACTION,
    NAME,
    NAME_KEYS,
    NON_EMPTY_KEYS,
    NON_NEGATIVE,
    POSITIVE,
    RANGES,
    Range,
)
from pipeline.config.schema import (
    REQUIRED,
    CheckpointConfig,
    Config,
    CooldownConfig,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    ScheduleConfig,
    SlurmExecutorConfig,
    TrackingConfig,
    TrainConfig,
    ValidationSet,
    ValSetConfig,
    schema_default,
)

__all__ = [
    "AT_LEAST_1",
    "EXECUTION_ONLY_KEYS",
    "FRACTION",
    "MODEL_OR_DATA_KEYS",
    "NAME",
    "NAME_KEYS",
    "NON_EMPTY_KEYS",
    "NON_NEGATIVE",
    "OUTPUT_DIR_KEYS",
    "RECIPE_KEYS",
    "POSITIVE",
    "PROJECT_CONFIGS",
    "RANGES",
    "REQUIRED",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "CooldownConfig",
    "DataConfig",
    "ModelConfig",
    "ParallelConfig",
    "Range",
    "RunConfig",
    "ScheduleConfig",
    "SlurmExecutorConfig",
    "TrackingConfig",
    "TrainConfig",
    "ValSetConfig",
    "ValidationSet",
    "apply_overrides",
    "changed_keys",
    "expand_output_dir",
    "relocate",
    "find_preset",
    "flatten",
    "result_hash",
    "from_dict",
    "load",
    "override_list",
    "parse_override",
    "preset_name",
    "read_yaml",
    "rules",
    "schema_default",
]
