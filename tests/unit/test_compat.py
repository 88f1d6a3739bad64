"""pipeline.compat's version differences between megatron-core 0.16.x and 0.19.x. That the model builds
under each (0.19's TransformerLayer passes name=) is shown by test_model.py, which both CI legs run."""

from __future__ import annotations

import pytest

from pipeline import compat

pytestmark = pytest.mark.megatron_compat


def test_an_unknown_argument_from_a_newer_megatron_is_an_error_naming_compat():
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['layer_spec_hint'\].*pipeline/compat.py"):
        compat.self_attention_extra_kwargs({"name": "decoder.layers.0.self_attention", "layer_spec_hint": 1})
