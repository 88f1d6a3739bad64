"""train.compile: the torch.compiled model gives the plain model's loss and gradients on CPU (same weights,
fp32). In the integration suite because compiling takes ~10 s; the helpers are the unit fusion tests'."""

from __future__ import annotations

from tests.integration.test_fusions import assert_same, build, plain  # noqa: F401  (plain: the fixture)


def test_compile_matches_the_plain_loss(plain):  # noqa: F811
    cfg, model = build("train.compile=true")
    assert model._compiled_call_impl is not None  # nn.Module.compile: compiled forward, same parameter names
    assert_same(plain, model)
