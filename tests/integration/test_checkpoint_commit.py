"""One commit for both kinds of save (pipeline.checkpoint.commit.commit_tag): a synchronous save (written by
the caller, settled at once) and a background one (staged to host memory, written by a thread) of the same
engine at the same step leave the same tag: the same files, byte for byte, and the same integrity record.
A real DeepSpeed engine (ZeRO-1, fp32, four layers) on gloo in this process."""

from __future__ import annotations

import dataclasses
import json
import shutil

import yaml

from pipeline import checkpoint, config
from tests.integration.test_train import PRESET

SMALL = [
    "model.num_layers=4",
    "schedule.heads=6x2,12x2",
    "model.seq_len=64",
    "train.micro_batch_size=1",
    "train.precision=fp32",
]


def test_synchronous_and_background_saves_leave_byte_identical_tags(tmp_path):
    import torch

    from pipeline import distributed
    from pipeline.checkpoint.restore import TrainState
    from pipeline.checkpoint.writer import Saver
    from pipeline.model import build_model, lm_loss
    from pipeline.train.engine import build_engine

    cfg = config.load(PRESET, [*SMALL, f"run.output_dir={tmp_path}", "tracking.enabled=false"])
    distributed.init_distributed("cpu")
    distributed.init_model_parallel(1, cfg.run.seed, device="cpu")
    engine, _ = build_engine(cfg, build_model(cfg), grad_accum=1, dp_size=1)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_len + 1))
    engine.backward(lm_loss(engine, tokens))
    engine.step()  # the AdamW moments exist
    tag = checkpoint.tag_for(5)

    def save(async_save: bool):
        c = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, async_save=async_save))
        saver = Saver(engine, c, "cpu")  # the background one stages from here on: the synchronous one goes first
        assert (saver.staging is not None) == async_save
        torch.manual_seed(7)  # the RNG states a checkpoint holds
        saver.save(TrainState(step=5, tokens_seen=5 * 1024, run_id="run-x"))
        saver.close()
        assert checkpoint.read_latest(cfg.checkpoint_dir) == tag
        return shutil.move(cfg.checkpoint_dir / tag, tmp_path / ("background" if async_save else "synchronous"))

    sync_dir, async_dir = save(False), save(True)
    names = {p.name for p in sync_dir.iterdir()}
    assert names == {p.name for p in async_dir.iterdir()}
    assert {"integrity.json", "config.yaml", checkpoint.MODEL_STATES} <= names and any("optim" in n for n in names)
    for name in names - {"integrity.json", "config.yaml"}:
        assert (sync_dir / name).read_bytes() == (async_dir / name).read_bytes(), name
    # the configs differ in the one key that chose the mode; the records in that file's entry only
    configs = [yaml.safe_load((d / "config.yaml").read_text()) for d in (sync_dir, async_dir)]
    assert [c["checkpoint"].pop("async_save") for c in configs] == [False, True] and configs[0] == configs[1]
    records = [json.loads((d / "integrity.json").read_text()) for d in (sync_dir, async_dir)]
    assert set(records[0]["files"]) == names - {"integrity.json"}
    for record in records:
        del record["files"]["config.yaml"]
    assert records[0] == records[1]
    assert records[0]["step"] == 5 and records[0]["dp_size"] == 1 and records[0]["tp"] == 1
    _, info = checkpoint.read_weights(async_dir)  # the readers' view: the step and run from the client state
    assert (info.step, info.run_id, info.client_state["tokens_seen"]) == (5, "run-x", 5 * 1024)
