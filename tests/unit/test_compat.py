"""pipeline.compat's version differences between megatron-core 0.16.x and 0.19.x. That the model builds
under each (0.19's TransformerLayer passes name=) is shown by test_model.py, which both CI legs run."""

from __future__ import annotations

import pytest

from pipeline import compat

pytestmark = pytest.mark.megatron_compat


def test_an_unknown_argument_from_a_newer_megatron_is_an_error_naming_compat():
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['layer_spec_hint'\].*pipeline/compat.py"):
        compat.self_attention_extra_kwargs({"name": "decoder.layers.0.self_attention", "layer_spec_hint": 1})


def test_flat_partitions_saved_at_one_dp_size_resplit_at_another_with_fresh_padding():
    import torch

    numel = 13  # DeepSpeed's bf16 layout: params flat, zeros to a multiple of 2 x DP, equal partitions
    group = torch.arange(1.0, numel + 1)
    saved = list(torch.cat([group, torch.zeros(3)]).chunk(2))  # DP=2: 16 elements, the last 3 padding
    for dp, partition_size in ((1, 14), (3, 6), (4, 4)):  # 13 rounded up to 2, 6, 8
        parts = [compat.reshard_flat_partitions(saved, numel, partition_size, r) for r in range(dp)]
        assert all(p.numel() == partition_size for p in parts)
        whole = torch.cat(parts)
        assert torch.equal(whole[:numel], group) and not whole[numel:].any(), dp


def test_elastic_resume_with_an_optimizer_it_cannot_resplit_is_one_line_naming_the_fix():
    import types

    import torch

    from pipeline.config import ConfigError

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)  # e.g. no ZeRO: a plain optimizer
    engine = types.SimpleNamespace(optimizer=sgd, loaded_checkpoint_dp_world_size=2, dp_world_size=4)
    with pytest.raises(
        ConfigError, match=r"saved at data-parallel size 2, this run has 4.*optimizer \(SGD\).*data-parallel size 2$"
    ):
        compat.load_zero_partitions_at_new_dp(engine, "/ckpt", "step-0000003")
