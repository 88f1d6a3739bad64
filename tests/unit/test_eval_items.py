"""Per-item eval files and bits per byte (pipeline.eval.items), and the pairing logic of the paired tables
(pipeline.verdict.paired): which runs pair, which tasks are left out, what the numbers are computed from."""

from __future__ import annotations

import gzip
import math

import numpy as np
import pytest

from pipeline import statistics
from pipeline.compare import RunSeries
from pipeline.eval import items as eval_items
from pipeline.verdict import paired


def sample(doc_id, target, arguments, lls, acc, acc_norm=None, doc=None):
    """One lm-eval logged sample as zeroshot.score reads it."""
    s = {
        "doc_id": doc_id,
        "doc": doc or {},
        "target": target,
        "arguments": arguments,
        "filtered_resps": [(ll, False) for ll in lls],
        "acc": acc,
    }
    if acc_norm is not None:
        s["acc_norm"] = acc_norm
    return s


def test_bpb_equals_a_hand_computation_over_the_gold_answers():
    # gold picked three ways: an index (hellaswag-like), a continuation's text (one context), winogrande's
    # multiple-input form (two contexts, one continuation; the doc's answer says which)
    samples = [
        sample(1, 1, [("Q:", " no"), ("Q:", " yes ä")], [-7.0, -5.5], 1, 1),  # gold " yes ä": 7 bytes
        sample(0, "b", [("Q:", " a"), ("Q:", " b")], [-1.25, -3.0], 0, 0),  # gold " b": 2 bytes
    ]
    items = eval_items.task_items("piqa", samples)
    assert items.ids[0].startswith("0-") and items.ids[1].startswith("1-")  # doc order, whatever the DP order
    assert items.gold_loglik.tolist() == [-3.0, -5.5] and items.gold_bytes.tolist() == [2, 7]
    assert items.bpb == pytest.approx((3.0 + 5.5) / (math.log(2) * (2 + 7)), abs=1e-6)

    wino = sample(
        0, "went home.", [("Ann", " went home."), ("Bob", " went home.")], [-9.0, -4.0], 1, doc={"answer": "2"}
    )
    w = eval_items.task_items("winogrande", [wino])
    assert w.acc_norm is None and w.gold_loglik.tolist() == [-4.0] and w.gold_bytes.tolist() == [11]
    assert w.ids[0] == eval_items.item_id(0, "Bob", " went home.")
    assert w.bpb == pytest.approx(4.0 / (math.log(2) * 11), abs=1e-6)
    # a multiple-input task whose gold the sample does not tell: no items (and no bpb), not a wrong gold
    assert eval_items.task_items("other", [wino]) is None


def test_item_file_is_deterministic_and_reads_back():
    items = {
        "piqa": eval_items.task_items("piqa", [sample(0, 0, [("Q:", " a"), ("Q:", " b")], [-1.5, -2.0], 1, 1)]),
        "winogrande": eval_items.task_items(
            "winogrande", [sample(3, "x.", [("A", " x."), ("B", " x.")], [-2.0, -1.0], 1, doc={"answer": "1"})]
        ),
    }
    data = eval_items.encode_items(items)
    assert data == eval_items.encode_items(dict(reversed(items.items())))  # byte-identical: mtime 0, sorted
    back = eval_items.decode_items(data)
    assert back["piqa"].ids == items["piqa"].ids and back["piqa"].acc_norm.tolist() == [1]
    assert back["winogrande"].acc_norm is None and back["winogrande"].gold_loglik.tolist() == [-2.0]
    assert eval_items.items_artifact(12) == "eval_items/step-0000012.csv.gz"
    with pytest.raises(ValueError, match="not a per-item eval file"):
        eval_items.decode_items(gzip.compress(b"task,acc\n"))


def test_per_sequence_file_round_trips_in_float32(tmp_path):
    losses = np.array([3.25, 4.5, 5.125], dtype=np.float64)
    path, data = eval_items.write_val(tmp_path, None, 7, losses)
    assert path == tmp_path / "val" / "step-0000007.npy" and path.read_bytes() == data
    back = eval_items.decode_val(data)
    assert back.dtype == np.float32 and back.tolist() == losses.tolist()
    assert eval_items.val_path(tmp_path, "wiki", 7) == tmp_path / "val" / "wiki" / "step-0000007.npy"
    assert eval_items.val_artifact("wiki", 7) == "val_items/wiki/step-0000007.npy"


def run(name, arm, seed, order="o1", schedule=""):
    return RunSeries(name, name, arm, "tiny", seed, "FINISHED", [], math.nan, schedule=schedule, data_order=order)


def test_seed_pairs_follow_the_data_order_rule():
    runs = [
        run("u1", "uniform", "1"),
        run("u2", "uniform", "2"),
        run("p1", "prism", "1", schedule="s"),
        run("p2", "prism", "2", order="o2", schedule="s"),  # another data order: not pairable with u2
    ]
    (group,) = paired.arm_pairs(runs)
    assert [(u.name, p.name) for u, p in group.pairs] == [("u1", "p1")]


def task(ids, correct, lls, nbytes):
    n = len(ids)
    return eval_items.TaskItems(
        list(ids), np.array(correct, np.int8), np.array(correct, np.int8), np.array(lls, float), np.full(n, nbytes)
    )


def test_paired_row_counts_discordant_items_and_leaves_mismatched_ids_out():
    group = paired.ArmPair("tiny", "s", [(run("u1", "uniform", "1"), run("p1", "prism", "1", schedule="s"))])
    n = 20
    ids = [f"{i}-abc" for i in range(n)]
    u_correct = [1] * 8 + [0] * 12
    p_correct = [1] * 7 + [0] + [1] * 3 + [0] * 9  # 1 item only uniform got right, 3 only prism
    u = task(ids, u_correct, -np.linspace(10, 20, n), 8)
    p = task(ids, p_correct, -np.linspace(9, 21, n), 8)
    row, why = paired.task_rows(group, "hellaswag", 4, [(group.pairs[0], (u, p))])
    assert why is None and row["metric"] == "acc_norm" and row["items"] == n and row["seed_pairs"] == 1
    assert row["delta"] == pytest.approx((3 - 1) / n)
    assert row["mcnemar_p"] == statistics.mcnemar(1, 3)
    assert row["delta_ci95_low"] <= row["delta"] <= row["delta_ci95_high"]
    assert row["delta_bpb"] == pytest.approx(p.bpb - u.bpb)  # the per-item shares add up to the task's bpb
    assert row["noise"] == paired.ITEM_NOISE

    other = task([f"{i}-xyz" for i in range(n)], p_correct, -np.linspace(9, 21, n), 8)
    row, why = paired.task_rows(group, "hellaswag", 4, [(group.pairs[0], (u, other))])
    assert row is None and "item ids differ between u1 and p1" in why


def test_token_losses_sit_beside_an_unchanged_mean(monkeypatch):
    """Validation's per-sequence losses come from the loss's per-token values (pipeline.model.loss): asking for
    them leaves the mean loss bit-identical, and each is that token's cross-entropy."""
    import torch
    import torch.nn.functional as F

    from pipeline import distributed
    from pipeline.model import loss as loss_mod

    distributed.init_model_parallel(1, 1234)
    monkeypatch.setitem(loss_mod.CHUNK_ELEMENTS, "cpu", 7 * 300)  # several chunks, a ragged last one
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(3, 20, 32, generator=gen), 0.5 * torch.randn(300, 32, generator=gen)
    targets = torch.randint(0, 300, (3, 20), generator=gen)
    per_token = torch.empty(60)
    with torch.no_grad():
        mean = loss_mod.linear_cross_entropy(hidden, weight, targets)
        assert loss_mod.linear_cross_entropy(hidden, weight, targets, token_losses=per_token).item() == mean.item()
    want = F.cross_entropy(F.linear(hidden, weight).reshape(60, 300), targets.reshape(60), reduction="none")
    torch.testing.assert_close(per_token, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(per_token.view(3, 20).double().mean(1).mean(), mean.double(), rtol=1e-6, atol=0)
