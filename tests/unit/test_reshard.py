"""Resume at another TP size: the TP layout of every weight (pipeline.model.tp_layout), the join of TP parts
the export uses, the layout as DeepSpeed's universal-checkpoint merge reads it (pipeline.checkpoint.reshard), and the
resume policy's line for what cannot be re-split. The whole resume runs in
tests/integration/test_elastic_resume.py."""

from __future__ import annotations

import pytest
import torch

from pipeline import checkpoint, config, model_size
from pipeline.checkpoint import restore
from pipeline.config import ConfigError
from pipeline.model.tp_layout import TPSplit, join, tp_split

TINY = "configs/tiny_prism.yaml"
REPLICATED_TP2 = ["parallel.tp=2", "parallel.replicate_indivisible_layers=true"]  # 3-head layers 1-2 replicate


@pytest.fixture(scope="module")
def names() -> list[str]:
    """The state-dict keys of the real tiny model (built on the meta device at TP=1: the names do not
    depend on the TP size), tensors only."""
    from pipeline import distributed
    from pipeline.model import build_model

    cfg = config.load(TINY)
    distributed.init_model_parallel(1, cfg.run.seed)
    return [k for k, v in build_model(cfg, meta=True).state_dict().items() if torch.is_tensor(v)]


def test_every_weight_of_the_model_has_a_tp_split(names):
    cfg = config.load(TINY, REPLICATED_TP2)
    splits = {name: tp_split(name, cfg) for name in names}
    whole = {n for n, s in splits.items() if s.dim is None}
    assert whole == {
        n for n in names if "layernorm" in n or n.startswith(("decoder.layers.0.self_", "decoder.layers.1.self_"))
    }
    assert {n for n, s in splits.items() if s.dim == 1} == {
        n for n in names if n.endswith(("linear_proj.weight", "linear_fc2.weight")) and n not in whole
    }
    assert {n for n, s in splits.items() if s.halves} == {n for n in names if n.endswith("linear_fc1.weight")}
    assert {n for n, s in splits.items() if s.vocab} == {"embedding.word_embeddings.weight"}  # tied output
    # without replication the same layers' attention is split like any other
    plain = config.load(TINY, ["schedule.heads=6x2,12x6", "parallel.tp=2"])
    assert tp_split("decoder.layers.0.self_attention.linear_qkv.weight", plain) == TPSplit(0)
    with pytest.raises(ValueError, match="no tensor-parallel split known for weight 'decoder.new.weight'"):
        tp_split("decoder.new.weight", cfg)


def megatron_parts(full: torch.Tensor, split: TPSplit, tp: int) -> list[torch.Tensor]:
    """How megatron cuts a whole weight over ``tp`` ranks (written out here, independently of join)."""
    if split.dim is None:
        return [full] * tp
    if split.halves:  # gate and up are each cut; rank r holds [gate_r; up_r]
        gate, up = full.chunk(2)
        return [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]
    return list(full.chunk(tp, dim=split.dim))


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_parts_join_back_to_the_whole_weight(tp):
    cfg = config.load(TINY, [f"parallel.tp={tp}", "schedule.heads=4x2,12x6", "model.vocab_size=50280"])
    d, f = cfg.model.d_model, cfg.model.ffn_hidden_size
    padded = model_size.padded_vocab(cfg)
    assert padded == {2: 50432, 4: 50688}[tp]  # 50280 rounded up to a multiple of 128 x TP: padding rows
    weights = {
        "decoder.layers.3.mlp.linear_fc1.weight": (2 * f, d),
        "decoder.layers.3.mlp.linear_fc2.weight": (d, f),
        "decoder.layers.3.self_attention.linear_qkv.weight": (3 * d, d),
        "decoder.layers.3.self_attention.linear_proj.weight": (d, d),
        "decoder.layers.3.input_layernorm.weight": (d,),
        "embedding.word_embeddings.weight": (padded, d),
    }
    for name, shape in weights.items():
        full, split = torch.randn(shape), tp_split(name, cfg)
        parts = megatron_parts(full, split, tp)
        assert torch.equal(join(parts, split), full), name
        if split.halves:  # a plain row join would interleave gate and up: the halves matter
            assert not torch.equal(torch.cat(parts), full)


def deepspeed_merge(tmp_path, info: dict, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """DeepSpeed's own universal-checkpoint merge of one parameter's TP parts (as ds_to_universal runs it)."""
    from deepspeed.checkpoint.ds_to_universal import merge_tp_slices

    slices, out = tmp_path / "slices", tmp_path / "out"
    for rank, part in enumerate(parts):
        folder = slices / name / str(rank)
        folder.mkdir(parents=True)
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            torch.save(part.reshape(-1).clone(), folder / f"{state}.00")
    unused = merge_tp_slices(info, str(out), str(slices), len(parts), (name, [p.shape for p in parts]))
    assert unused == set()  # DeepSpeed used the pattern declared for it
    return torch.load(out / name / "fp32.pt", weights_only=False)["param"]


@pytest.mark.parametrize(
    "name",
    [
        "decoder.layers.2.mlp.linear_fc1.weight",  # gate/up halves
        "decoder.layers.2.mlp.linear_fc2.weight",  # row-parallel
        "decoder.layers.2.self_attention.linear_qkv.weight",  # column-parallel, no pattern
        "decoder.layers.0.self_attention.linear_qkv.weight",  # replicated attention (3 heads at TP=2)
        "decoder.layers.2.pre_mlp_layernorm.weight",
        "embedding.word_embeddings.weight",  # padded vocab
    ],
)
def test_deepspeeds_merge_reads_the_declared_layout(tmp_path, name):
    from pipeline.checkpoint import reshard

    saved = config.load(TINY, [*REPLICATED_TP2, "model.vocab_size=50280"])  # padded to 50432 at TP=2
    now = config.load(TINY, ["model.vocab_size=50280"])  # 50304 at TP=1
    d, f = saved.model.d_model, saved.model.ffn_hidden_size
    shape = {"fc1": (2 * f, d), "fc2": (d, f), "qkv": (3 * d, d), "norm": (d,), "embe": (50432, d)}
    key = next(k for k in shape if k in name.replace("layernorm", "norm").replace("word_embeddings", "embe"))
    full = torch.randn(shape[key])
    info = reshard.universal_info({name: ()}, saved, now)
    assert info["original_vocab_size"] == 50304  # the rows both sizes have
    merged = deepspeed_merge(tmp_path, info, name, megatron_parts(full, tp_split(name, saved), 2))
    want = full[:50304] if key == "embe" else full
    assert torch.equal(merged, want)


def test_a_tp_change_needs_zero_partitions_and_says_so_in_one_line(tmp_path):
    def saved_at(zero_stage: int):
        out, stage = f"run.output_dir={tmp_path / str(zero_stage)}", f"parallel.zero_stage={zero_stage}"
        cfg = config.load(TINY, [out, stage, "parallel.replicate_indivisible_layers=true"])  # inert at TP=1
        tag = cfg.checkpoint_dir / checkpoint.tag_for(3)
        tag.mkdir(parents=True)
        (tag / checkpoint.CONFIG_NAME).write_text(cfg.dump())
        return tag, cfg

    tag, _ = saved_at(1)
    now = config.load(TINY, [f"run.output_dir={tmp_path / '1'}", *REPLICATED_TP2])
    restore.check_resume_policy(now, tag, saved_dp=1, dp=1)  # ZeRO-1: re-split at load
    tag, _ = saved_at(0)
    now = config.load(TINY, [f"run.output_dir={tmp_path / '0'}", "parallel.zero_stage=0", *REPLICATED_TP2])
    with pytest.raises(ConfigError) as refused:
        restore.check_resume_policy(now, tag, saved_dp=1, dp=1)
    line = str(refused.value)
    assert "\n" not in line and "cannot resume at parallel.tp=2, the checkpoint was written at parallel.tp=1" in line
    assert "needs parallel.zero_stage 1 or 2 (saved at 0, this run 0)" in line and "resume with parallel.tp=1" in line


def test_a_failed_conversion_is_one_line_and_leaves_nothing(tmp_path):
    from pipeline.checkpoint import reshard

    cfg = config.load(TINY)
    tag = tmp_path / "checkpoints" / checkpoint.tag_for(3)
    tag.mkdir(parents=True)  # no DeepSpeed files at all
    out = tmp_path / "checkpoints" / restore.UNIVERSAL / tag.name
    with pytest.raises(ConfigError) as failed:
        reshard.to_universal(tag, out, cfg, cfg)
    line = str(failed.value)
    assert "\n" not in line and line.startswith(f"{tag}: converting it to DeepSpeed's universal checkpoint")
    assert "can't find *_optim_states.pt files" in line  # DeepSpeed's own last line names the cause
    assert line.endswith(f"free space in {out.parent}")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [tag.name]
