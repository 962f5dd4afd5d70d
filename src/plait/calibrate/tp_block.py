"""A tensor-parallel decoder layer timed as a run computes it: every TP group of a section at once, each
rank's kernels and the group's collectives interleaved.

The collectives of ``plait.calibrate.collectives`` run back to back, every rank ready at once. In a run a
collective starts when the group's slowest rank reaches it, and processes that outnumber the cores reach it
at times the kernel's scheduler decides: a rank that finished its kernels waits for one still queued for a
core, and a rank woken by its peers' data waits for a core to run on. To measure that wait, three things
are timed in alternation, so that a change of the machine's speed touches all three alike:

* the layer, sharded by plait's TP plan (``plait.tensor_parallel``), forward + backward;
* its compute twin: an unsharded plait ``DecoderLayer`` with this rank's heads, KV heads and FFN width, the
  same kernels without a collective (under sequence parallelism its norms see the whole sequence, not the
  rank's slice: a little more work, so the wait comes out a little low);
* the layer's collectives back to back (``collectives.one_call``), on tensors of the same sizes.

The wait per collective is (layer - twin - collectives) / collectives per layer, the median over the repeats;
``plan.timing.tp_wait`` adds it to every TP collective of a run.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from plait.calibrate import collectives as coll
from plait.plan import eager
from plait.plan.model import llama_ffn

BUDGET_S = 2.0  # time each (group size, sequence parallel) figure is measured for, after a warm-up: the wait
# is a few per cent of the layer, so it needs many repeats to stand out of the machine's noise
MIN_REPS, MAX_REPS = 8, 100


def group_sizes(processes: int) -> list[int]:
    """TP group sizes timed in a section of ``processes``: those the block's heads and widths divide over."""
    _, _, h, heads, kv = eager.TP_CALIBRATION_BLOCK
    return [g for g in coll.group_sizes(processes) if heads % g == 0 and kv % g == 0 and llama_ffn(h) % g == 0]


def collectives_per_layer(sp: bool) -> tuple[tuple[str, int], ...]:
    """(op, count) of one layer's forward + backward TP collectives: per region an all-reduce out (forward)
    and in (backward); under SP a gather in and a scatter out, each again in backward."""
    return (("all_gather", 4), ("reduce_scatter", 4)) if sp else (("all_reduce", 4),)


def _parts(group, sp: bool, device: torch.device, dtype: torch.dtype):
    """(layer step, twin step, collectives step) closures of this rank's shard of the calibration layer."""
    from plait.distributed.context import tp_group_context
    from plait.models.family import family_of
    from plait.models.llama import DecoderLayer, Llama, LlamaConfig
    from plait.tensor_parallel.plan import apply_tp_plan

    b, s, h, heads, kv = eager.TP_CALIBRATION_BLOCK
    ctx = tp_group_context(group, device)
    t = ctx.tp_size
    cfg = LlamaConfig(vocab_size=256, dim=h, n_layers=1, n_heads=heads, n_kv_heads=kv, ffn_dim=llama_ffn(h),
                      max_seq_len=s)
    model = Llama(cfg)
    family = family_of(model)
    plan = family.tp_plan(model)
    assert plan is not None  # the decoder family always has one
    apply_tp_plan(model, plan, ctx, sequence_parallel=sp, n_kv_heads=family.kv_heads(cfg))
    layer = model.layers[0].to(device=device, dtype=dtype)
    x = torch.randn(b, s // t if sp else s, h, device=device, dtype=dtype, requires_grad=True)  # [B, S or S/t, h]
    g = torch.randn_like(x)
    twin_cfg = LlamaConfig(vocab_size=256, dim=h, n_layers=1, n_heads=heads // t, n_kv_heads=max(kv // t, 1),
                           head_dim=h // heads, ffn_dim=llama_ffn(h) // t, max_seq_len=s)
    twin = DecoderLayer(twin_cfg).to(device=device, dtype=dtype)
    xt = torch.randn(b, s, h, device=device, dtype=dtype, requires_grad=True)  # [B, S, h]
    gt = torch.randn_like(xt)
    rank_in = dist.get_process_group_ranks(group).index(dist.get_rank())
    nbytes = b * s * h * torch.finfo(dtype).bits // 8  # the full hidden state each collective moves
    calls = [coll.one_call(op, nbytes, group, t, rank_in, device) for op, n in collectives_per_layer(sp)
             for _ in range(n)]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run_layer() -> None:
        layer(x).backward(g)
        sync()

    def run_twin() -> None:
        twin(xt).backward(gt)
        sync()

    def run_calls() -> None:
        for call in calls:
            call()
        sync()

    return run_layer, run_twin, run_calls


def measure(processes: int, g: int, sp: bool, groups: list, world_group, device: torch.device,
            budget: float = BUDGET_S) -> tuple[float, float]:
    """(mean seconds of the layer's forward + backward, wait per collective) on ranks ``[0, processes)`` in
    groups of ``g``, every group at once, averaged over the ranks, over about ``budget`` seconds; collective
    over the whole world (ranks beyond ``processes`` wait)."""
    rank = dist.get_rank()
    mine = next((gr for gr in groups if rank in dist.get_process_group_ranks(gr)), None) \
        if rank < processes else None
    reps = torch.zeros(1, device=device)
    parts = None
    if mine is not None:
        parts = _parts(mine, sp, device, torch.float32)
        t0 = time.perf_counter()
        for fn in parts:  # warm-up (and the groups' connections)
            fn()
        reps[0] = max(MIN_REPS, min(MAX_REPS, int(budget / max(time.perf_counter() - t0, 1e-6))))
    dist.broadcast(reps, src=0, group=world_group)  # every member runs each part as often as its peers
    dist.barrier(group=world_group)
    out = torch.zeros(2, device=device)
    if parts is not None:
        n = sum(k for _, k in collectives_per_layer(sp))
        layer_s, waits = [], []
        for _ in range(int(reps[0])):
            spent = []
            for fn in parts:
                t0 = time.perf_counter()
                fn()
                spent.append(time.perf_counter() - t0)
            layer_s.append(spent[0])
            waits.append((spent[0] - spent[1] - spent[2]) / n)
        out[0], out[1] = statistics.mean(layer_s), statistics.median(waits)
    dist.all_reduce(out, group=world_group)
    return float(out[0]) / processes, float(out[1]) / processes


def measure_all(processes: int, groups: dict, world_group, device: torch.device, tick=lambda what: None,
                quick: bool = False) -> dict[tuple[int, bool], tuple[float, float]]:
    """(group size, sequence parallel) -> (layer seconds, wait per collective) for every TP group size of the
    section (collective); ``quick``: without sequence parallelism, a quarter of the time (noisier)."""
    out = {}
    for g in group_sizes(processes):
        for sp in (False,) if quick else (False, True):
            out[(g, sp)] = measure(processes, g, sp, groups[(processes, g)], world_group, device,
                                   BUDGET_S / 4 if quick else BUDGET_S)
            tick(f"tensor-parallel layer over {g} of {processes} processes{' (SP)' if sp else ''}")
    return out
