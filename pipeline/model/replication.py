"""Replicated attention under TP: a layer whose head count TP does not divide runs whole on every TP rank.

Which layers replicate is the config's per-layer plan (parallel.replicate_indivisible_layers); here is how:
megatron builds a module's weights split over its process groups' TP group, so such a layer's attention
gets a 1-rank "TP group" (its QKV/O weights whole, no TP collectives), and its weights are marked whole
copies. The identical replicas see identical inputs and gradients, so they stay identical.
"""

from __future__ import annotations

import copy

import torch

_SINGLE_RANK_GROUPS: list | None = None


def single_rank_groups() -> list:
    """One process group per global rank holding only that rank (a "TP group" of size 1 for replicated
    attention). Collective: the first call must happen on every rank."""
    global _SINGLE_RANK_GROUPS
    if _SINGLE_RANK_GROUPS is None:
        world = torch.distributed.get_world_size()
        _SINGLE_RANK_GROUPS = [torch.distributed.new_group([r]) for r in range(world)]
    return _SINGLE_RANK_GROUPS


def replicated_attention_groups(pg_collection):
    """megatron's process groups for one attention module, with its TP group swapped for this rank's
    1-rank group: megatron then builds the QKV/O weights whole and runs no TP collectives for it."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    pg_collection = copy.copy(pg_collection)
    pg_collection.tp = single_rank_groups()[torch.distributed.get_rank()]
    return pg_collection


def mark_replicated(parameters) -> None:
    """Mark a replicated module's weights as whole copies: megatron's parallel linears flag every weight as
    a TP shard, even in a 1-rank group, and DeepSpeed's grad norm would then count them once per TP rank."""
    for p in parameters:
        p.tensor_model_parallel = False
