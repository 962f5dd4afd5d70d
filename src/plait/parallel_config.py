"""``ParallelConfig``: the one description of a parallel layout and how it steps (no torch import).

Every entry point takes it: ``plait.init`` and ``plait.parallelize`` (whose keyword forms build one),
``TrainConfig`` and ``VerifyConfig`` (each holds one), the CLI (one option per field, its help the field's
docstring) and the planner (``plan.Layout.to_parallel_config``). It is checked once, when it is built:
a bad value raises ``plait.ConfigError`` naming the field and the valid choices, before any collective.
``resolve(world)`` adds the checks that need the world size and infers ``dp=-1``.

Adding an allowed value (say a recompute mode) is one edit of the tuple constant below; adding a field is
one annotated attribute with its docstring plus its check in ``_check``.
"""

from __future__ import annotations

import ast
import inspect
import math
import textwrap
from dataclasses import dataclass, fields, replace
from functools import cache

from plait.errors import ConfigError, FieldError, divisors, is_integer, plain_numbers
from plait.schedules import SCHEDULE_NAMES, Schedule, build_schedule

#: activation recomputation modes the runtime runs
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")
#: ZeRO stages plait.optim implements (optimizer state sharded over data-parallel ranks from stage 1, gradients
#: from 2, parameters at 3; stage 3 under the schedules without a split backward: ZERO3_SCHEDULES)
ZERO_LEVELS: tuple[int, ...] = (0, 1, 2, 3)
#: the schedules ZeRO-3 runs under: those whose every backward is whole (no split into input- and weight-gradient
#: passes), with one chunk per pipeline rank or several
ZERO3_SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved-1f1b", "looped-bfs")
#: compute precisions (bf16: bf16 weights and activations per step over fp32 master weights)
PRECISIONS: tuple[str, ...] = ("fp32", "bf16")
#: how context-parallel ranks exchange keys and values (plait.context_parallel)
CP_COMMS: tuple[str, ...] = ("allgather", "ring")
#: query rows per score tile of context parallelism's blockwise attention (plait.context_parallel.blockwise)
CP_TILE = 512


def cp_chunks(local_len: int, cp: int, rank: int) -> tuple[range, range]:
    """Global positions of the two chunks CP rank ``rank`` holds of a row cut into ``2·cp`` chunks of
    ``local_len // 2`` tokens: chunks ``rank`` and ``2·cp - 1 - rank`` (an early and a late one: causal attention's
    work balanced over the ranks). The runtime's layout and the planner's host model read it here."""
    c = local_len // 2
    return range(rank * c, (rank + 1) * c), range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)


@dataclass(frozen=True)
class ParallelConfig:
    """How a model is spread over ranks and how one training step runs: world = tp·cp·pp·dp, TP innermost,
    then CP, then DP, then PP (global rank = ((pp_rank·dp + dp_rank)·cp + cp_rank)·tp + tp_rank; with cp = 1
    that is (pp_rank·dp + dp_rank)·tp + tp_rank); expert parallelism lives inside the dp·cp·tp plane of each
    pipeline stage."""

    tp: int = 1
    """Tensor-parallel size: ranks that split each layer (Megatron column/row-parallel linears)."""
    pp: int = 1
    """Pipeline-parallel size: stages, each holding consecutive layers."""
    dp: int = -1
    """Data-parallel size: model replicas that see different data (-1: the world size over tp·pp)."""
    cp: int = 1
    """Context-parallel size: ranks that split every sequence (2·cp chunks, rank r keeps chunks r and
    2·cp-1-r) and exchange keys and values in attention; every CP rank is handed the same full rows."""
    cp_comm: str = "allgather"
    """How context-parallel ranks exchange keys and values: allgather (all-gather of K/V, reduce-scatter of
    their gradients) or ring (K/V blocks passed point to point, partial attentions merged by log-sum-exp)."""
    ep: int = 1
    """Expert-parallel size: the experts of each MoE layer are spread over ep ranks of the dp x cp x tp plane."""
    expert_tp: bool = False
    """Split each expert over the TP group (Megatron expert tensor parallelism); ep must then divide dp·cp."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved-1f1b, looped-bfs, zb-h1, zbv, dualpipev."""
    microbatches: int | None = None
    """Micro-batches M that each pipeline (one per data-parallel replica) runs per optimizer step: a step's
    batch is dp x M micro-batches, so the global batch size must be a multiple of dp x M and a micro-batch
    holds batch / (dp x M) sequences. More micro-batches shrink the pipeline bubble (1F1B's is
    (pp-1)/(M+pp-1)) and make each micro-batch smaller. Unset (None): pp, one per pipeline stage."""
    virtual_stages: int | None = None
    """Model chunks per pipeline rank (unset: 2 for interleaved-1f1b, looped-bfs, zbv and dualpipev, else 1)."""
    rounds: str | None = None
    """interleaved-1f1b / zb-h1 with microbatches % pp != 0: equal rounds (unset; the smaller bubble) or padded
    (rounds of pp: fewer micro-batches held)."""
    sequence_parallel: bool = False
    """Shard norms and residuals along the sequence between TP regions (their activations / tp)."""
    recompute: str = "none"
    """Activation recomputation: none; selective (each attention core - QK^T, softmax, weighted sum - is
    recomputed during backward from its saved q, k, v); or full (every block recomputes its forward)."""
    zero: int = 0
    """ZeRO stage of plait.optim: 0 replicated optimizer state, 1 fp32 masters and optimizer state sharded over
    data-parallel ranks, 2 gradients sharded too, 3 parameters sharded too (gathered per block for each
    micro-batch's forward and backward; under a schedule without a split backward: 1f1b, gpipe, interleaved-1f1b,
    looped-bfs)."""
    precision: str = "fp32"
    """fp32, or bf16 (bf16 weights and activations over fp32 master weights and gradients)."""

    def __post_init__(self) -> None:
        plain_numbers(self)
        _check(self)

    # ------------------------------------------------------------------------------------------ derived
    @property
    def world(self) -> int:
        """tp·cp·pp·dp (only meaningful once dp is known, see ``resolve``)."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def num_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else self.pp

    def pipeline_schedule(self) -> Schedule:
        """The pipeline schedule this configuration runs (pure Python: plait.schedules)."""
        return build_schedule(self.schedule, stages=self.pp, microbatches=self.num_microbatches,
                              virtual=self.virtual_stages, rounds=self.rounds)

    def resolve(self, world: int) -> ParallelConfig:
        """This configuration checked against ``world`` processes, with dp inferred when it is -1."""
        tp, cp, pp, dp = self.tp, self.cp, self.pp, self.dp
        names = ("tp", "cp", "pp") if cp > 1 else ("tp", "pp")  # cp named only when it is used
        inner = tp * cp * pp
        label, values = "*".join(names), "*".join(str(getattr(self, n)) for n in names)
        if dp == -1:
            if world % inner:
                raise ConfigError(f"{label}={values}={inner} does not divide the world size {world}; valid {label} "
                                  f"products: {divisors(world)}")
            dp = world // inner
        if inner * dp != world:
            raise ConfigError(f"{label}*dp = {values}*{dp} = {inner * dp} but the world size is {world}; choose "
                              f"{', '.join(names)}, dp whose product is {world} ({', '.join(names)} from "
                              f"{divisors(world)}, or pass dp=-1)")
        return replace(self, dp=dp, expert_tp=self.expert_tp and tp > 1)

    def check_seq_len(self, seq_len: int) -> None:
        """ConfigError unless sequences of ``seq_len`` tokens split as this layout cuts them: into 2·cp equal
        chunks under context parallelism (each rank keeps two), each rank's part again over tp with sequence
        parallelism."""
        if self.cp == 1:
            return
        unit = 2 * self.cp
        if self.sequence_parallel and self.tp > 1:
            unit = math.lcm(unit, self.cp * self.tp)  # each rank's S/cp tokens are cut over tp too
        if seq_len % unit:
            split = self.sequence_parallel and self.tp > 1
            sp = (", each rank's part cut again over {tp} with sequence parallelism ({sequence_parallel})"
                  if split else "")
            others: dict[str, object] = {"cp": self.cp, **({"tp": self.tp, "sequence_parallel": True} if split else {})}
            below = seq_len // unit * unit
            near = f"{below} or {below + unit}" if below else f"{unit}"
            raise FieldError("seq_len", seq_len, f"must be a multiple of {unit} under {{cp}} (2·cp chunks of equal "
                             f"length{sp}); valid lengths: {unit}, {2 * unit}, {3 * unit}, ..., the nearest {near}",
                             others)

    def check_batch(self, inputs: tuple[int, ...], targets: tuple[int, ...] | None) -> None:
        """ConfigError unless a local batch of these shapes (the inputs', the targets' if any) splits as this
        layout cuts it: its rows into micro-batches, its sequences over cp (and tp under sequence parallelism)."""
        if inputs[0] % self.num_microbatches:
            raise ConfigError(f"the local batch size {inputs[0]} is not divisible by microbatches="
                              f"{self.num_microbatches}; use a batch that is a multiple of it")
        if targets is not None and targets[0] != inputs[0]:
            raise ConfigError(f"targets have batch size {targets[0]}, inputs {inputs[0]}")
        if self.cp > 1:  # every CP rank holds the same full rows, cut into 2·cp chunks
            if len(inputs) < 2:
                raise ConfigError(f"cp={self.cp} splits sequences: inputs must be [batch, seq], got shape {inputs}")
            self.check_seq_len(inputs[1])
        if self.sequence_parallel and len(inputs) > 1 and inputs[1] % self.tp:
            raise ConfigError(f"sequence length {inputs[1]} must be divisible by tp={self.tp} with "
                              "sequence_parallel=True")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, values: dict) -> ParallelConfig:
        """The configuration of the ParallelConfig keys of ``values`` (other keys are ignored)."""
        names = field_names()
        return cls(**{k: v for k, v in values.items() if k in names})


def _positive(name: str, value, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not is_integer(value) or value < 1:
        raise FieldError(name, value, "must be a positive integer" + (" (or left unset: the default)" * optional))


def _choice(name: str, value, allowed: tuple) -> None:
    if isinstance(value, bool) or value not in allowed:
        raise FieldError(name, value, f"choose one of {', '.join(map(str, allowed))}")


def _check(c: ParallelConfig) -> None:
    """Every rule that needs no world size; ConfigError names the field."""
    for name in ("tp", "pp", "cp", "ep"):
        _positive(name, getattr(c, name))
    if c.dp != -1 and (not is_integer(c.dp) or c.dp < 1):
        raise FieldError("dp", c.dp, "must be a positive integer or -1 (inferred from the world size)")
    _positive("microbatches", c.microbatches, optional=True)
    _positive("virtual_stages", c.virtual_stages, optional=True)
    for name in ("expert_tp", "sequence_parallel"):
        if not isinstance(getattr(c, name), bool):
            raise FieldError(name, getattr(c, name), "must be True or False")
    if c.schedule not in SCHEDULE_NAMES:
        raise FieldError("schedule", c.schedule, f"unknown; valid names are {', '.join(SCHEDULE_NAMES)}")
    _choice("recompute", c.recompute, RECOMPUTE_MODES)
    _choice("zero", c.zero, ZERO_LEVELS)
    _choice("precision", c.precision, PRECISIONS)
    _choice("cp_comm", c.cp_comm, CP_COMMS)
    try:  # virtual_stages and microbatches against the schedule (e.g. dualpipev: M >= 2·pp)
        schedule = c.pipeline_schedule()
    except FieldError as exc:  # said with this class's field names
        field = {"virtual": "virtual_stages", "stages": "pp"}.get(exc.name, exc.name)
        raise FieldError(field, getattr(c, field), exc.detail) from None
    split = any(a.kind == "I" for row in schedule.actions for a in row)
    if c.zero == 3 and split:
        raise FieldError("schedule", c.schedule, "not with {zero}: this schedule splits backwards and defers the "
                         "weights' gradients to later weight passes (several micro-batches' at once on later stages), "
                         "while ZeRO-3 reduce-scatters a block's gradients as soon as its backward has completed them; "
                         "the weight passes read no gathered weight (a weight's gradient is its input times its output "
                         "gradient), but their gradients come outside the backward, mixed over micro-batches, which "
                         "ZeRO-3's reducer does not take; valid schedules with {zero}: "
                         f"{', '.join(ZERO3_SCHEDULES)} (or keep this schedule with ZeRO-1 or ZeRO-2)", {"zero": 3})
    if c.dp == -1:
        return
    data = c.dp * c.cp  # ranks of a stage that see different tokens with the same TP coordinate
    if c.expert_tp and c.tp > 1 and data % c.ep:
        ranks = "{dp}" if c.cp == 1 else f"{{dp}} × {{cp}} = {data}"
        raise FieldError("ep", c.ep, f"must divide {ranks} with {{expert_tp}} (every TP rank holds a shard of the same "
                         f"experts, so EP spans data- and context-parallel ranks); valid: {divisors(data)}",
                         {"dp": c.dp, "cp": c.cp, "expert_tp": True})
    plane = "dp*tp" if c.cp == 1 else "dp*cp*tp"
    if (data * c.tp) % c.ep:
        raise FieldError("ep", c.ep, f"must divide {plane}={data * c.tp}; valid: {divisors(data * c.tp)}")


def batch_split(batch_size: int, dp: int) -> tuple[int, list[int]]:
    """(a replica's sequences, 0 where ``dp`` does not divide ``batch_size``; the micro-batch counts that cut them
    into equal micro-batches): what a batch that does not split into replicas of equal micro-batches offers."""
    per_replica = batch_size // dp if batch_size % dp == 0 else 0
    return per_replica, divisors(per_replica) if per_replica else []


def field_names() -> list[str]:
    return [f.name for f in fields(ParallelConfig)]


@cache
def field_docs(cls: type = ParallelConfig) -> dict[str, str]:
    """Each dataclass field's docstring (the string literal under it), read from the class source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs
