"""The Prism idea: a per-layer attention-head schedule.

A uniform Transformer gives every layer ``h_base`` heads of ``d_model / h_base`` dims. Prism gives layer l
``h_l`` heads of ``d_model / h_l`` dims with h_1 <= ... <= h_L = h_base: few wide heads early, the baseline
late. Q/K/V/O stay d x d, so parameters and FLOPs do not change (pipeline.model_size counts them).

A schedule is written as a list of head counts or in compact form, ``"3x2,6x2,8x2,12x6"`` (count x layers).
Rules (from the paper): hard ones are always errors; the paper's guidelines are errors unless a config sets
``allow_guideline_violations`` (so Table 5's ablations stay expressible).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pipeline.model_size import layer_flops, layer_params

# FlashAttention kernels support head dims up to 256; d_h 384 cost the paper 8.3 % throughput.
MAX_HEAD_DIM = 256
# Head dims at or below this need not be powers of two (the paper's late stages use 96).
FREE_HEAD_DIM = 128


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message names the rule and the layers (1-indexed)."""


@dataclass(frozen=True)
class Violation:
    rule: str  # short name: divisibility, monotonic, final-baseline, tensor-parallel, staircase, ...
    hard: bool
    message: str

    def __str__(self) -> str:
        kind = "rule" if self.hard else "guideline"
        return f"{kind} '{self.rule}': {self.message}"


def parse(spec: str | Sequence[int]) -> tuple[int, ...]:
    """``"3x2,6x2,12x8"``, ``"3,3,6,6"`` or a list of ints -> per-layer head counts."""
    if isinstance(spec, str):
        heads: list[int] = []
        for part in spec.replace(" ", "").split(","):
            if not part:
                continue
            count, _, repeat = part.partition("x")
            try:
                heads += [int(count)] * (int(repeat) if repeat else 1)
            except ValueError:
                raise ScheduleError(
                    f"cannot read schedule part {part!r}: write head counts like '3,3,6' or '3x2,6x2'"
                ) from None
    else:
        heads = [int(h) for h in spec]
    if not heads or any(h < 1 for h in heads):
        raise ScheduleError(f"schedule {spec!r} must list at least one positive head count per layer")
    return tuple(heads)


def compact(heads: Sequence[int]) -> str:
    """Per-layer head counts -> compact form (``12x12`` for the uniform 124M model)."""
    return ",".join(f"{h}x{end - start}" for h, start, end in stages(heads))


def stages(heads: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs of equal head counts as (heads, first layer index, end index), 0-indexed, end exclusive."""
    runs: list[tuple[int, int, int]] = []
    for i, h in enumerate(heads):
        if runs and runs[-1][0] == h:
            runs[-1] = (h, runs[-1][1], i + 1)
        else:
            runs.append((h, i, i + 1))
    return runs


def _layers(indices: Sequence[int]) -> str:
    return ", ".join(str(i + 1) for i in indices)


def check(
    heads: Sequence[int], d_model: int, h_base: int, tp: int = 1, *, replicate_indivisible: bool = False
) -> list[Violation]:
    """Every rule and guideline the schedule breaks (empty list: it is a valid Prism schedule)."""
    return broken_rules(heads, d_model, h_base, tp, replicate_indivisible) + broken_guidelines(heads, d_model, h_base)


def broken_rules(
    heads: Sequence[int], d_model: int, h_base: int, tp: int, replicate_indivisible: bool
) -> list[Violation]:
    """The hard rules: without them the model cannot be built or is not a Prism schedule."""
    out: list[Violation] = []
    bad = [i for i, h in enumerate(heads) if d_model % h]
    if bad:
        out.append(
            Violation(
                "divisibility",
                True,
                f"d_model {d_model} is not divisible by the heads of layer(s) {_layers(bad)}",
            )
        )
    drops = [i for i in range(1, len(heads)) if heads[i] < heads[i - 1]]
    if drops:
        out.append(
            Violation(
                "monotonic",
                True,
                f"head counts must not decrease (h_1 <= ... <= h_L); layer(s) {_layers(drops)} have fewer heads than the layer before",
            )
        )
    if heads[-1] != h_base:
        out.append(
            Violation("final-baseline", True, f"the last layer must have h_base={h_base} heads, it has {heads[-1]}")
        )
    not_tp = [i for i, h in enumerate(heads) if h % tp]
    if not_tp and not replicate_indivisible:
        out.append(
            Violation(
                "tensor-parallel",
                True,
                f"with tensor parallel size {tp} every head count must be a multiple of {tp}; layer(s) {_layers(not_tp)} have {sorted({heads[i] for i in not_tp})} heads",
            )
        )
    return out


def broken_guidelines(heads: Sequence[int], d_model: int, h_base: int) -> list[Violation]:
    """The paper's guidelines: errors unless a config sets allow_guideline_violations."""
    out: list[Violation] = []
    runs = stages(heads)
    short_or_long = [(h, s, e) for h, s, e in runs[:-1] if not 2 <= e - s <= 4]
    if short_or_long:
        desc = "; ".join(
            f"{h} heads for {e - s} layer(s) at layer(s) {_layers(range(s, e))}" for h, s, e in short_or_long
        )
        out.append(Violation("staircase", False, f"every stage before the baseline stage must hold 2-4 layers: {desc}"))
    n_base = sum(1 for h in heads if h == h_base)
    if n_base < len(heads) / 2:
        out.append(
            Violation(
                "baseline-preservation",
                False,
                f"at least {len(heads) / 2:g} of {len(heads)} layers must use h_base={h_base} heads, {n_base} do",
            )
        )
    wide = sorted({d_model // h for h in heads if d_model % h == 0 and d_model // h > FREE_HEAD_DIM})
    odd = [d for d in wide if d & (d - 1) or d > MAX_HEAD_DIM]
    if odd:
        out.append(
            Violation(
                "head-dim",
                False,
                f"head dims above {FREE_HEAD_DIM} must be powers of two and at most {MAX_HEAD_DIM} (FlashAttention); this schedule has d_h {odd}",
            )
        )
    return out


# --- the per-layer plan: one replication decision for the model, the capture hook and the FLOP counter ---
@dataclass(frozen=True)
class LayerPlan:
    number: int  # 1-based, as megatron's layer_number
    heads: int
    head_dim: int
    replicated: bool  # attention whole on every TP rank: heads not a multiple of TP (opt-in)


def plan_layers(
    heads: Sequence[int], d_model: int, tp: int = 1, *, replicate_indivisible: bool = False
) -> tuple[LayerPlan, ...]:
    """Every layer's heads, head dim and whether its attention runs replicated under TP. Without the
    opt-in an indivisible layer is a 'tensor-parallel' rule violation (``check``), never replicated."""
    return tuple(LayerPlan(i + 1, h, d_model // h, replicate_indivisible and h % tp != 0) for i, h in enumerate(heads))


@dataclass(frozen=True)
class Verdict:
    """Everything the rules say about one schedule on one model: what a loaded config carries
    (``Config.schedule_verdict``) and what ``prism schedule validate`` prints."""

    heads: tuple[int, ...]
    violations: tuple[Violation, ...]  # every rule and guideline broken, allowed or not
    allow_guideline_violations: bool
    layers: tuple[LayerPlan, ...]  # the per-layer plan (heads, head dim, replicated under TP)

    @property
    def errors(self) -> tuple[Violation, ...]:
        return tuple(v for v in self.violations if v.hard or not self.allow_guideline_violations)

    @property
    def warnings(self) -> tuple[Violation, ...]:
        """Guidelines broken with the config's permission (Table 5's ablations)."""
        return tuple(v for v in self.violations if v not in self.errors)

    def error_line(self) -> str:
        return f"schedule {compact(self.heads)}: " + " | ".join(map(str, self.errors))

    def warning_lines(self) -> list[str]:
        return [f"schedule {compact(self.heads)}: allowed {v}" for v in self.warnings]


def judge(
    heads: Sequence[int],
    d_model: int,
    h_base: int,
    tp: int = 1,
    *,
    allow_guideline_violations: bool = False,
    replicate_indivisible: bool = False,
) -> Verdict:
    """The rules' answer for ``heads`` (parsed) on this model and TP size, with the replication opt-in."""
    heads = tuple(heads)
    return Verdict(
        heads,
        tuple(check(heads, d_model, h_base, tp, replicate_indivisible=replicate_indivisible)),
        allow_guideline_violations,
        plan_layers(heads, d_model, tp, replicate_indivisible=replicate_indivisible),
    )


# --- presets: the paper's schedules (Table 4) and the 124M ablations (Table 5) ------------------------
PRESETS: dict[str, str] = {
    "paper-124m": "3x2,6x2,8x2,12x6",
    "paper-354m": "4x3,8x3,16x18",
    "paper-757m": "6x3,12x3,16x18",
    "uniform-124m": "12x12",
    "uniform-354m": "16x24",
    "uniform-757m": "16x24",
    # Table 5 (124M, 12 layers, h_base 12). Config-1 and Config-5 ramp one layer per stage.
    "table5-config-1": "3,6,8,12x9",
    "table5-config-2": "6x2,8x2,12x8",
    "table5-config-3": "4x2,8x2,12x8",
    "table5-config-4": "6x4,12x8",
    "table5-config-5": "2,4,6,8,12x8",
    "table5-config-6": "3x2,6x2,12x8",
    "table5-config-7": "2x2,4x2,8x2,12x6",
}


def preset(name: str) -> tuple[int, ...]:
    if name not in PRESETS:
        raise ScheduleError(f"unknown schedule preset {name!r}; known: {', '.join(PRESETS)}")
    return parse(PRESETS[name])


def resolve(spec: str | Sequence[int]) -> tuple[int, ...]:
    """A preset name or a schedule literal -> head counts."""
    return preset(spec) if isinstance(spec, str) and spec in PRESETS else parse(spec)


# --- enumeration: every schedule that passes all rules (feeds sweeps) -------------------------------
def enumerate_valid(
    d_model: int, layers: int, h_base: int, tp: int = 1, *, replicate_indivisible: bool = False
) -> Iterator[tuple[int, ...]]:
    """Yield every schedule that ``check`` passes, depth-first over stages.

    A valid schedule never decreases and ends at h_base, so it is a run of stages with rising head counts
    below h_base, then the baseline stage. The search appends one stage at a time and asks ``check`` about
    the prefix completed with baseline layers. Whatever that completion breaks stays broken in every longer
    prefix (a layer's own rules, a stage's length, a shrinking baseline), so a failed completion ends the
    branch: the rules live in ``check`` alone, and the search stays fast."""

    def broken(heads: tuple[int, ...]) -> bool:
        return bool(check(heads, d_model, h_base, tp, replicate_indivisible=replicate_indivisible))

    def grow(prefix: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        rest = layers - len(prefix)
        if broken(prefix + (h_base,) * rest):
            return
        yield prefix + (h_base,) * rest
        lowest = prefix[-1] + 1 if prefix else 1
        for h in range(lowest, h_base):
            for run in range(1, rest):  # leave at least one baseline layer
                yield from grow(prefix + (h,) * run)

    if layers >= 1:
        yield from grow(())


# --- the per-layer table `prism schedule validate` and `show` print (sizes from pipeline.model_size) ---
def layer_table(heads: Sequence[int], d_model: int, ffn_hidden: int, seq_len: int, *, gated: bool = True) -> str:
    """Per layer: heads, d_h, progressive stage, forward FLOPs per token (attention, projections), params."""
    rows = [
        f"{'layer':>5} {'heads':>5} {'d_h':>4} {'stage':>5} {'attn FLOPs/tok':>15} {'proj FLOPs/tok':>15} {'params':>11}"
    ]
    stage_of = {i: n + 1 for n, (_, s, e) in enumerate(stages(heads)) for i in range(s, e)}
    for i, h in enumerate(heads):
        f = layer_flops(d_model, ffn_hidden, h, seq_len, gated=gated)
        rows.append(
            f"{i + 1:>5} {h:>5} {d_model // h:>4} {stage_of[i]:>5} {f['attention']:>15,} "
            f"{f['projections']:>15,} {layer_params(d_model, ffn_hidden, h, gated=gated):>11,}"
        )
    return "\n".join(rows)
