"""`prism export`: a checkpoint as a self-contained Hugging Face model folder, and the way back in
(`train.init_from`).

The uniform arm (one head count in every layer) maps onto a native transformers architecture: StableLM for
LayerNorm models, whose block is ours (pre-LayerNorm with bias, bias-free q/k/v/o, SwiGLU, rotate-half RoPE
over partial_rotary_factor of the head, set to 1.0, tied embeddings), and Llama for RMSNorm ones. A Prism
schedule has no native class: it ships configuration_prism.py + modeling_prism.py and an auto_map.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from pipeline.config import Config, ConfigError

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
REMOTE_CODE = ("configuration_prism.py", "modeling_prism.py")
MAX_SHARD_SIZE = "2GB"  # above this model.safetensors is split into shards plus an index
LOG_FOLDER_BELOW = 200 * 2**20  # exports up to this size go to MLflow whole; larger ones as a link
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def architecture(cfg: Config) -> str:
    """stablelm | llama (one head count everywhere: native transformers) or prism (remote code)."""
    if len(set(cfg.heads_per_layer)) > 1:
        return "prism"
    return "llama" if cfg.model.norm == "rmsnorm" else "stablelm"


def check_exportable(cfg: Config) -> None:
    m = cfg.model
    if m.activation != "swiglu" or m.bias:
        raise ConfigError(
            f"{cfg.source}: model.activation={m.activation}, model.bias={m.bias}: export supports the SwiGLU, "
            "bias-free models the presets train (activation: swiglu, bias: false)"
        )


def hf_config(cfg: Config, eos_id: int, dtype: str):
    """The transformers config object for ``cfg``'s model (its class decides the architecture)."""
    m, arch = cfg.model, architecture(cfg)
    common = dict(
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        max_position_embeddings=m.seq_len,
        tie_word_embeddings=m.tie_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        dtype="bfloat16" if dtype == "bf16" else "float32",
    )
    if arch == "prism":
        from pipeline.export.configuration_prism import PrismConfig

        config = PrismConfig(
            **common,
            heads_per_layer=[layer.heads for layer in cfg.layer_plan],
            head_dim_per_layer=[layer.head_dim for layer in cfg.layer_plan],
            norm=m.norm,
            norm_eps=m.norm_eps,
            rope_theta=m.rope_base,
        )
        config.auto_map = {
            "AutoConfig": "configuration_prism.PrismConfig",
            "AutoModelForCausalLM": "modeling_prism.PrismForCausalLM",
        }
        config.architectures = ["PrismForCausalLM"]
        return config
    heads = cfg.heads_per_layer[0]
    rope = {"rope_type": "default", "rope_theta": m.rope_base, "partial_rotary_factor": 1.0}
    shape = dict(num_attention_heads=heads, num_key_value_heads=heads, hidden_act="silu", rope_parameters=rope)
    if arch == "llama":
        from transformers import LlamaConfig

        config = LlamaConfig(
            **common,
            **shape,
            rms_norm_eps=m.norm_eps,
            attention_bias=False,
            mlp_bias=False,
            head_dim=m.d_model // heads,
        )
        config.architectures = ["LlamaForCausalLM"]
        return config
    from transformers import StableLmConfig

    config = StableLmConfig(
        **common,
        **shape,
        layer_norm_eps=m.norm_eps,
        use_qkv_bias=False,
        qk_layernorm=False,
        use_parallel_residual=False,
    )
    config.architectures = ["StableLmForCausalLM"]
    return config


def default_out(cfg: Config, tag_dir: Path) -> Path:
    return cfg.run_dir / "hf" / tag_dir.name


def check_out(out: Path, force: bool) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ConfigError(f"--out {out}: exists and is not empty; pass --force to replace it, or another --out")
    # a regular file on the way (`--out notes.txt/hf`): mkdir would raise FileExistsError/NotADirectoryError
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConfigError(f"--out {out}: {blocker} is a file, not a folder; pass an --out whose parents are folders")


def run_facts(tag_dir: Path) -> dict[str, Any]:
    """git commit and the last val loss up to the checkpoint, from the run's tracking journal (None where
    the journal has none)."""
    from pipeline.tracking.journal import Journal

    facts: dict[str, Any] = {"git_commit": None, "val_loss": None, "val_step": None}
    for record in Journal(tag_dir.parent).records():
        if record.get("op") == "start":
            facts["git_commit"] = (record.get("tags") or {}).get("git_commit")
        if "val/loss" in (record.get("metrics") or {}):
            facts["val_loss"], facts["val_step"] = record["metrics"]["val/loss"], record.get("step")
    return facts


def model_card(cfg: Config, info, arch: str, parameters: int, dtype: str, facts: dict[str, Any]) -> str:
    load = "AutoModelForCausalLM.from_pretrained(DIR" + (", trust_remote_code=True)" if arch == "prism" else ")")
    rows = "\n".join(f"| {p.number} | {p.heads} | {p.head_dim} |" for p in cfg.layer_plan)
    val = f"{facts['val_loss']:.4f} (step {facts['val_step']})" if facts["val_loss"] is not None else "not recorded"
    tokens = info.client_state.get("tokens_seen")
    return f"""# {cfg.run_name} (step {info.step})

A {cfg.run.arm}-arm model of the Prism study, exported by `prism export` from `{info.tag_dir.resolve()}`.

- architecture: `{arch}` ({"native transformers" if arch != "prism" else "remote code: modeling_prism.py"});
  load with `{load}`
- parameters: {parameters:,} ({dtype}); d_model {cfg.model.d_model}, {cfg.model.num_layers} layers,
  context {cfg.model.seq_len}, vocabulary {cfg.model.vocab_size}
- data: `{cfg.data.dataset_dir}`; tokens seen: {f"{tokens:,}" if tokens else "unknown"}
- final val loss: {val}
- MLflow run id: {info.run_id or "none"}; git commit: {facts["git_commit"] or "unknown"}

| layer | heads | head dim |
| --- | --- | --- |
{rows}
"""


def export(
    checkpoint_path: str | Path,
    out: str | Path | None = None,
    dtype: str | None = None,
    force: bool = False,
    overrides: list[str] | None = None,
    log: bool = True,
) -> dict[str, Any]:
    """Write the Hugging Face folder for a checkpoint; returns {out, architecture, parameters, mlflow}.
    log=False: a scratch export, not logged to the run's MLflow (prism generate on a checkpoint)."""
    from huggingface_hub import save_torch_state_dict

    from pipeline import checkpoint
    from pipeline.export import convert
    from pipeline.inference import load_config, load_tokenizer, read_whole_weights

    tag_dir = checkpoint.resolve_tag_dir(checkpoint_path)
    cfg = load_config(tag_dir, overrides)
    check_exportable(cfg)
    dtype = dtype or ("bf16" if cfg.train.precision == "bf16" else "fp32")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    out = Path(out) if out else default_out(cfg, tag_dir)
    check_out(out, force)
    problem = checkpoint.verify(tag_dir)
    if problem:
        raise ConfigError(f"{tag_dir}: {problem}; use another checkpoint of the run")
    _, eos_id = load_tokenizer(cfg)  # refuses a missing tokenizer before anything is written
    weights, info = read_whole_weights(tag_dir, cfg)
    if info.run_id is None:
        from pipeline.tracking.journal import journal_run_id

        info.run_id = journal_run_id(tag_dir.parent)
    hf_weights = {k: v.to(DTYPES[dtype]) for k, v in convert.to_hf(weights, cfg).items()}
    arch = architecture(cfg)
    parameters = sum(v.numel() for v in hf_weights.values())

    with written_whole(out) as tmp:
        save_torch_state_dict(hf_weights, tmp, max_shard_size=MAX_SHARD_SIZE)
        hf_config(cfg, eos_id, dtype).save_pretrained(tmp)
        if arch == "prism":
            for name in REMOTE_CODE:
                shutil.copyfile(HERE / name, tmp / name)
        save_tokenizer(cfg, eos_id, tmp)
        (tmp / "README.md").write_text(model_card(cfg, info, arch, parameters, dtype, run_facts(tag_dir)))
    return {
        "out": str(out),
        "architecture": arch,
        "parameters": parameters,
        "dtype": dtype,
        "step": info.step,
        "mlflow": log_export(cfg, info, out) if log else {"logged": False, "reason": "scratch export"},
    }


@contextmanager
def written_whole(out: Path) -> Iterator[Path]:
    """A private folder beside ``out`` to write the export into; when the block ends it replaces ``out``, so the
    folder appears whole or not at all, and on any error it is removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield tmp
        for path in tmp.iterdir():  # mkdtemp made the folder private; the export is for sharing
            path.chmod(0o644)
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_tokenizer(cfg: Config, eos_id: int, folder: Path) -> None:
    """The run's tokenizer, and a generation config whose BOS, EOS and pad are its EOS token."""
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    from pipeline.inference import tokenizer_file

    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(folder)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_file(cfg)), eos_token=cfg.data.eos_token, model_max_length=cfg.model.seq_len
    )
    tokenizer.save_pretrained(folder)


def log_export(cfg: Config, info, out: Path) -> dict[str, Any]:
    """The folder as an artifact of the checkpoint's MLflow run, or a text file naming it when it is large.
    Never raises: tracking being down must not fail the export."""
    from pipeline.tracking.store import log_to_run

    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    if size <= LOG_FOLDER_BELOW:
        return log_to_run(cfg, info.run_id, {}, info.step, [("hf", out)])
    with tempfile.TemporaryDirectory() as folder:
        link = Path(folder) / f"{out.name}.location.txt"
        link.write_text(f"{out.resolve()}\n{size:,} bytes, not uploaded\n")
        return log_to_run(cfg, info.run_id, {}, info.step, [("hf", link)])


# --- back in: train.init_from ---------------------------------------------------------------------------
def read_export(export_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json as a dict, the weights in fp32) of an export folder, sharded or not."""
    from safetensors.torch import load_file

    folder = Path(export_dir)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    if not (folder / "config.json").is_file() or not all((folder / f).is_file() for f in files):
        raise ConfigError(f"train.init_from={folder}: not a `prism export` folder (config.json, model.safetensors)")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update({k: v.float() for k, v in load_file(folder / name).items()})
    return json.loads((folder / "config.json").read_text()), weights


def check_shape(cfg: Config, hf: dict[str, Any], folder: Path) -> None:
    """One line naming the first model dimension where the export and the run's config differ."""
    m = cfg.model
    heads = hf.get("heads_per_layer") or [hf.get("num_attention_heads")] * hf.get("num_hidden_layers", 0)
    pairs = [
        ("model.d_model", m.d_model, hf.get("hidden_size")),
        ("model.num_layers", m.num_layers, hf.get("num_hidden_layers")),
        ("model.ffn_hidden_size", m.ffn_hidden_size, hf.get("intermediate_size")),
        ("model.vocab_size", m.vocab_size, hf.get("vocab_size")),
        ("schedule.heads", list(cfg.heads_per_layer), heads),
        ("model.tie_embeddings", m.tie_embeddings, hf.get("tie_word_embeddings")),
    ]
    for key, ours, theirs in pairs:
        if ours != theirs:
            raise ConfigError(
                f"train.init_from={folder}: the export has {key}={theirs}, the config {ours}; "
                f"set {key} to match the export or init from another export"
            )


def init_from(model, cfg: Config, export_dir: str | Path) -> None:
    """Load an export's weights into the freshly built TP=1 ``model`` (step 0 of a new run)."""
    from pipeline.export import convert

    if cfg.parallel.tp != 1:
        raise ConfigError(f"train.init_from needs parallel.tp=1 (this run has {cfg.parallel.tp})")
    hf, weights = read_export(export_dir)
    check_shape(cfg, hf, Path(export_dir))
    like = model.state_dict()
    try:
        state = convert.from_hf(weights, cfg, like)
    except (KeyError, ValueError, RuntimeError) as e:
        raise ConfigError(f"train.init_from={export_dir}: {e}; init from an export of a model of this shape") from None
    model.load_state_dict(state, strict=True)
