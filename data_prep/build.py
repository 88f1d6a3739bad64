"""`prepare(cfg)`: checks, then one datatrove pipeline (reader -> TokenizeToShards) on the configured
executor (both built by data_prep.executor), then manifest.json.

Data identity: the keys that change the tokens (input, format, columns, limit, tokenizer file hash, EOS,
seq_len, val_fraction, packing sizes) are hashed into ``config_hash``. Execution keys (executor, workers,
slurm) are not. ``tasks`` is not either, but it fixes the shard layout (which files each task reads, what
each task drops): a finished dataset is reused whatever ``tasks`` is now, while an unfinished build resumes only
with the same ``tasks`` (datatrove's completions are per rank).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from data_prep.corpus import build_embedded_corpora, train_bpe_tokenizer
from data_prep.executor import INPUT_GLOBS, build_executor, build_manifest_executor, build_pipeline
from data_prep.manifest import PREP, STATE, data_hash, first_difference, read_json, write_manifest
from pipeline.atomic import folder_write_problem, write_atomic, write_failure_cause
from pipeline.config import Config
from pipeline.dataset import MANIFEST, DataError, dtype_for_vocab, eos_id, sha256_file

EMBEDDED_CORPUS_BYTES = 8_000_000  # ~2M tokens: enough for the tiny presets, built in ~20 s
EMBEDDED_CORPUS_FILES = 8
# A validation set's embedded corpus (data.val_sets with an input that does not exist yet): the text right after
# the training corpus, ~80k tokens of the tiny BPE, a few validation passes' worth.
HELDOUT_CORPUS_BYTES = 300_000
HELDOUT_CORPUS_FILES = 2


def _is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


# --- input ------------------------------------------------------------------------------------------
def check_input(cfg: Config) -> None:
    """Local input: the folder exists, holds files of the format, and parquet files have the text column."""
    d = cfg.data
    if _is_remote(d.input):
        return  # listed by the reader inside the tasks; no network probe here
    root = Path(d.input.removeprefix("file://"))
    if not root.exists():
        raise DataError(f"data.input={d.input}: path not found; point it at a folder of {d.input_format} files")
    files = sorted(root.glob(INPUT_GLOBS[d.input_format])) if root.is_dir() else [root]
    if not files:
        raise DataError(
            f"data.input={d.input}: no {d.input_format} files in it; add some or fix data.input / data.input_format"
        )
    if d.input_format in ("parquet", "embedded"):
        import pyarrow.parquet as pq

        for f in files:
            try:
                names = pq.read_schema(f).names
            except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
                raise DataError(f"{f}: not a readable parquet file ({e})") from None
            if d.text_key not in names:
                raise DataError(
                    f"{f}: no column {d.text_key!r} (columns: {', '.join(names)}); set data.text_key to the text column"
                )


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def resolve_tokenizer(cfg: Config) -> str:
    """Path of a local tokenizer.json: the configured file, or a Hub name fetched (or found in the HF cache)."""
    name = cfg.data.tokenizer
    if Path(name).is_file():
        return name
    if name.endswith(".json") or os.sep in name and not _looks_like_hub_repo(name):
        raise DataError(f"data.tokenizer={name}: tokenizer file not found; pass the path of a tokenizer.json")
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(name, "tokenizer.json", local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached: try the Hub below
        pass
    if not _hub_reachable():
        raise DataError(
            f"data.tokenizer={name}: a Hub name, and the Hub is unreachable (offline); pass a local tokenizer.json "
            "path, e.g. data.tokenizer=runs/data/embedded-bpe8k.json"
        )
    try:
        return hf_hub_download(name, "tokenizer.json")
    except Exception as e:  # noqa: BLE001
        raise DataError(
            f"data.tokenizer={name}: no tokenizer.json on the Hub ({type(e).__name__}); pass a local tokenizer.json path"
        ) from None


def _looks_like_hub_repo(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/")) and not Path(name).parent.is_dir()


def tokenizer_info(path: str, eos_token: str, vocab_limit: int) -> dict[str, Any]:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{path}: not a tokenizers tokenizer.json ({e}); pass a valid file") from None
    eos = eos_id(tok, eos_token, path)
    vocab = tok.get_vocab_size()
    if vocab > vocab_limit:
        raise DataError(
            f"model.vocab_size={vocab_limit} is smaller than the tokenizer's vocabulary ({vocab}); set "
            f"model.vocab_size={vocab}"
        )
    return {"name_or_path": path, "vocab_size": vocab, "eos_id": eos, "sha256": sha256_file(path)}


def data_identity(cfg: Config, tok: dict[str, Any]) -> dict[str, Any]:
    """Everything that changes the bytes of the shards (flat, dotted keys so a refusal can name one)."""
    d = cfg.data
    return {
        "data.input": d.input,
        "data.input_format": d.input_format,
        "data.text_key": d.text_key,
        "data.id_key": d.id_key,
        "data.limit": d.limit,
        "data.tokenizer": d.tokenizer,
        "tokenizer.sha256": tok["sha256"],
        "data.eos_token": d.eos_token,
        "data.val_fraction": d.val_fraction,
        "model.seq_len": cfg.model.seq_len,
        "data.sequences_per_sample": d.sequences_per_sample,
        "data.samples_per_shard": d.samples_per_shard,
        "data.val_samples_per_shard": d.val_samples_per_shard,
        "dtype": dtype_for_vocab(tok["vocab_size"]),
    }


# --- output folder ------------------------------------------------------------------------------------
def check_output(out: Path, ident: dict[str, Any], tasks: int, overwrite: bool) -> str:
    """'done' (a finished dataset of this config), 'resume', or 'fresh'; refuses a foreign folder."""
    if not out.exists() or not any(out.iterdir()):
        return "fresh"
    hint = "use another data.dataset_dir, or pass --overwrite to delete it and rebuild"
    manifest, state = out / MANIFEST, out / STATE
    if overwrite:
        if not manifest.exists() and not state.exists() and not (out / "train").exists():
            raise DataError(f"{out}: holds files that are not a Prism dataset; refusing to delete it with --overwrite")
        shutil.rmtree(out)
        return "fresh"
    if manifest.exists():
        old = read_json(manifest).get("config", {})
        if (diff := first_difference(old, ident)) is None:
            return "done"
        raise DataError(f"{out}: holds a dataset made with another data config, first differing key {diff}; {hint}")
    if state.exists():
        old_state = read_json(state)
        if (diff := first_difference(old_state["identity"], ident)) is not None:
            raise DataError(
                f"{out}: holds an unfinished build of another data config, first differing key {diff}; {hint}"
            )
        if old_state["tasks"] != tasks:
            raise DataError(
                f"{out}: an unfinished build with data.tasks={old_state['tasks']}, now data.tasks={tasks} (tasks fix "
                f"the shard layout); resume with data.tasks={old_state['tasks']}, or pass --overwrite"
            )
        return "resume"
    raise DataError(f"{out}: exists and holds files that are not a Prism dataset; {hint}")


# --- file-system errors -------------------------------------------------------------------------------------
def check_writable(folder: Path, key: str) -> None:
    """``folder`` can be created and written (probed before any work): otherwise one line with the path."""
    if (cause := folder_write_problem(folder)) is not None:
        raise DataError(f"{folder}: cannot create or write this folder ({cause}); point {key} at a writable folder")


@contextmanager
def write_errors(doing: str, where: Path, state: str, key: str = "data.dataset_dir", kept: str = "") -> Iterator[None]:
    """An OS error while writing (disk full, ulimit -f, permissions; also re-raised from a datatrove worker)
    becomes one line: the cause, what was being written where, the state that leaves, and the way on."""
    try:
        yield
    except OSError as e:
        if e.errno is None:  # not a system call's error (e.g. pyarrow's own IO errors): not ours to word
            raise
        cause = write_failure_cause(e, where)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = "free space and rerun"
        elif e.errno == errno.EFBIG:
            fix = "raise the limit (ulimit -f) and rerun"
        else:
            fix = f"make it writable (or point {key} elsewhere) and rerun"
        raise DataError(f"{cause} while {doing} in {where}; {state}: {fix}{kept}") from None


# --- entry point ------------------------------------------------------------------------------------------
def prepare_inputs(cfg: Config) -> str:
    """Embedded format: build the corpus (and the held-out corpora of data.val_sets, in the same walk) and
    train the tokenizer when missing. Returns the tokenizer path."""
    d = cfg.data
    if d.input_format == "embedded":
        held_out = sorted({s.input for s in d.val_sets.values() if s.input and not Path(s.input).exists()})
        if not Path(d.input).exists() or held_out:
            missing = [p for p in (d.input, *held_out) if not Path(p).exists()]
            where, key = Path(d.input).parent, "data.input (or run.output_dir)"
            for path in missing:
                check_writable(Path(path).parent, key)
            print(
                f"prism prepare: building the embedded corpus (text installed with Python) -> {', '.join(missing)}",
                flush=True,
            )
            slices = [(None if Path(d.input).exists() else d.input, EMBEDDED_CORPUS_BYTES, EMBEDDED_CORPUS_FILES)]
            slices += [(path, HELDOUT_CORPUS_BYTES, HELDOUT_CORPUS_FILES) for path in held_out]
            with write_errors("building the embedded corpus", where, "no corpus was written", key):
                build_embedded_corpora(slices)
        if d.tokenizer.endswith(".json") and not Path(d.tokenizer).exists():  # a path, not a Hub name
            where, key = Path(d.tokenizer).parent, "data.tokenizer (or run.output_dir)"
            check_writable(where, key)
            print(
                f"prism prepare: training a BPE tokenizer (vocab {cfg.model.vocab_size}) -> {d.tokenizer}", flush=True
            )
            with write_errors("writing the tokenizer", where, "no tokenizer file was written", key):
                train_bpe_tokenizer(d.input, d.tokenizer, cfg.model.vocab_size, d.eos_token)
    check_input(cfg)
    return resolve_tokenizer(cfg)


def prepare(cfg: Config, overwrite: bool = False, quiet: bool = False) -> Path:
    """Build (or resume) ``cfg.data.dataset_dir``, then each validation set of data.val_sets that names an
    input; returns the path of the training data's manifest.json.

    With ``data.executor=slurm`` this submits the job array (+ a dependent manifest job) and returns the path the
    manifest will have once those jobs finished.
    """
    manifest = prepare_dataset(cfg, overwrite, quiet)
    for name, spec in sorted(cfg.data.val_sets.items()):
        if spec.input is not None:
            if not quiet:
                print(f"prism prepare: validation set data.val_sets.{name} -> {spec.dataset_dir}", flush=True)
            prepare_dataset(val_set_config(cfg, name), overwrite, quiet)
    return manifest


def val_set_config(cfg: Config, name: str) -> Config:
    """What a validation set's dataset is prepared with: the run's tokenizer, seq_len, packing and executor,
    the set's own folder and input, every document to the val split, no validation sets of its own."""
    spec = cfg.data.val_sets[name]
    data = dataclasses.replace(cfg.data, dataset_dir=spec.dataset_dir, input=spec.input, val_fraction=1.0, val_sets={})
    return dataclasses.replace(cfg, data=data)


def prepare_dataset(cfg: Config, overwrite: bool = False, quiet: bool = False) -> Path:
    """Build (or resume) ``cfg.data.dataset_dir`` alone; returns the path of its manifest.json."""
    d = cfg.data
    if d.val_samples_per_shard < 1 or d.tasks < 1:
        raise DataError("data.val_samples_per_shard and data.tasks must be >= 1")
    tokenizer_path = prepare_inputs(cfg)
    tok = tokenizer_info(tokenizer_path, d.eos_token, cfg.model.vocab_size)
    ident = data_identity(cfg, tok)
    out = Path(d.dataset_dir)
    check_writable(out, "data.dataset_dir")
    status = check_output(out, ident, d.tasks, overwrite)
    if status == "done":
        if not quiet:
            print(f"prism prepare: {out / MANIFEST} is up to date (config hash {data_hash(ident)}); nothing to do")
        return out / MANIFEST
    unmarked = "nothing of this build is marked complete (no manifest)"
    with write_errors("writing the build state", out, unmarked):
        (out / PREP).mkdir(parents=True, exist_ok=True)
        if status == "fresh":
            state = {"identity": ident, "tasks": d.tasks, "tokenizer": {**tok, "name_or_path": d.tokenizer}}
            write_atomic(out / STATE, _json(state))
    logs_dir = (out / PREP / "logs").resolve()
    executor = build_executor(cfg, build_pipeline(cfg, tokenizer_path, ident, tok["eos_id"]), logs_dir)
    start = time.perf_counter()
    if d.executor == "slurm":
        build_manifest_executor(cfg, executor, logs_dir).run()  # launches its dependency (the array) first
        if not quiet:
            print(
                f"prism prepare: submitted Slurm job {executor.job_id} ({d.tasks} tasks); "
                f"{out / MANIFEST} appears when it finishes"
            )
        return out / MANIFEST
    from pipeline.console import library_output_to_log

    with library_output_to_log() as log:
        if not quiet:
            where = f"; datatrove's own log: {log}" if log else ""
            print(f"prism prepare: tokenising into shards with datatrove ({d.tasks} tasks){where}", flush=True)
        with write_errors("writing shards", out, unmarked, kept=", the shards of finished tasks are kept"):
            executor.run()
    with write_errors(
        f"writing {MANIFEST}",
        out,
        "every shard is written, the manifest is not",
        kept=" (only the manifest is left to write)",
    ):
        manifest_path = write_manifest(out)
    if not quiet:
        m = read_json(manifest_path)
        t, secs = m["totals"], time.perf_counter() - start
        print(
            f"prism prepare: {t['documents']} documents, {t['tokens_written']} tokens written "
            f"({t['tokens_dropped']} dropped) in {t['shards']} shards (train {len(m['splits']['train']['shards'])}, "
            f"val {len(m['splits']['val']['shards'])}), {t['tokens_encoded'] / max(secs, 1e-9):,.0f} tokens/s "
            f"-> {manifest_path}"
        )
    return manifest_path


def _json(obj: Any) -> bytes:
    import json

    return (json.dumps(obj, indent=1) + "\n").encode()
