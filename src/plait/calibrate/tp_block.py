"""A tensor-parallel decoder layer timed as a run computes it: every TP group of a section at once, each
rank's kernels and the group's collectives interleaved.

The collectives of ``plait.calibrate.collectives`` run back to back in a tight loop, every rank ready and
running. In a run a collective starts when the group's slowest rank reaches it, and processes that outnumber
the cores reach it at times the kernel's scheduler decides: a rank that finished its kernels waits for one
still queued for a core, and a rank woken by its peers' data waits for a core to run on. To measure what a
collective costs there, two things are timed in alternating rounds, so that a change of the machine's speed
touches both alike:

* the layer, sharded by plait's TP plan (``plait.tensor_parallel``), forward + backward;
* its compute twin: an unsharded plait ``DecoderLayer`` with this rank's heads, KV heads and FFN width, the
  same kernels without a collective (under sequence parallelism its norms see the whole sequence, not the
  rank's slice: a little more work, so the collectives come out a little cheap).

Every rank of the section starts a round at once (a barrier) and runs the same part a few times, as in a run
every rank runs the same layers. Alternating call by call instead lets the groups drift into opposite phases
on a shared core, one group's twin computing while the other waits in its collectives: time then moves from
the twin to the layer and back from one launch to the next (tp2 on four processes of two cores, the same
layer: 13-19 ms of layer less twin in three launches, 28-35 ms in two others; in rounds, 11-18 ms in all).

The layer less its twin is what its collectives cost inside a run; ``plan.host.costs.HostCosts.tp_wait`` takes what that
is beyond the same collectives timed back to back, per collective, as the wait of every TP collective, and
``plan.host.compute.in_tp_step`` costs a sharded layer's compute at its twin's level, so that the two add up to
the layer timed.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from plait.calibrate import collectives as coll
from plait.devices import synchronize
from plait.distributed.collectives import collective
from plait.plan.host import shapes
from plait.plan.model import llama_ffn

BUDGET_S = 1.2  # time each (shape, group size, sequence parallel) figure is measured for, after a warm-up:
# the wait is a few per cent of the layer, so it needs repeats to stand out of the machine's noise
ROUND_CALLS = 4  # calls of one part per round, every rank of the section on the same part
MIN_ROUNDS, MAX_ROUNDS = 2, 25


def group_sizes(processes: int) -> list[int]:
    """TP group sizes timed in a section of ``processes``: those every block's heads and widths divide over."""
    return [g for g in coll.group_sizes(processes)
            if all(heads % g == 0 and kv % g == 0 and llama_ffn(h) % g == 0
                   for _, _, h, heads, kv in shapes.TP_CALIBRATION_BLOCKS)]


def _parts(shape: tuple[int, ...], group, sp: bool, device: torch.device, dtype: torch.dtype):
    """(layer step, twin step) closures of this rank's shard of the calibration layer of ``shape``."""
    from plait.distributed.context import tp_group_context
    from plait.models.llama import DecoderLayer, Llama, LlamaConfig
    from plait.models.registry import family_of
    from plait.tensor_parallel.plan import apply_tp_plan

    b, s, h, heads, kv = shape
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

    def run_layer() -> None:
        layer(x).backward(g)
        synchronize(device)

    def run_twin() -> None:
        twin(xt).backward(gt)
        synchronize(device)

    return run_layer, run_twin


def measure(shape: tuple[int, ...], processes: int, g: int, sp: bool, groups: list, world_group,
            device: torch.device, budget: float = BUDGET_S, calls: int = ROUND_CALLS) -> tuple[float, float]:
    """(mean seconds of the ``shape`` layer's forward + backward, of its twin's) on ranks ``[0, processes)`` in groups
    of ``g``, every group at once, averaged over the ranks, over about ``budget`` seconds of alternating
    rounds (the layer's, then the twin's; ``calls`` of each part per round); collective over the whole world
    (ranks beyond ``processes`` only join the rounds' barriers)."""
    rank = dist.get_rank()
    mine = next((gr for gr in groups if rank in dist.get_process_group_ranks(gr)), None) \
        if rank < processes else None
    rounds = torch.zeros(1, device=device)
    parts = None
    if mine is not None:
        parts = _parts(shape, mine, sp, device, torch.float32)
        t0 = time.perf_counter()
        for fn in parts:  # warm-up (and the groups' connections)
            fn()
        per_round = calls * max(time.perf_counter() - t0, 1e-6)
        rounds[0] = max(MIN_ROUNDS, min(MAX_ROUNDS, int(budget / per_round)))
    collective("calibration's broadcast of a TP layer's rounds", world_group,  # each part as often on every member
               lambda: dist.broadcast(rounds, src=0, group=world_group))
    spent = [0.0, 0.0]
    for _ in range(int(rounds[0])):
        for i in range(2):
            collective("calibration's barrier before a timed TP layer", world_group,  # the section starts together
                       lambda: dist.barrier(group=world_group))
            if parts is not None:
                t0 = time.perf_counter()
                for _ in range(calls):
                    parts[i]()
                spent[i] += time.perf_counter() - t0
    total = int(rounds[0]) * calls
    out = torch.tensor([spent[0] / total, spent[1] / total], device=device)  # means: see kernels.timed
    collective("calibration's all-reduce of a TP layer's times", world_group,
               lambda: dist.all_reduce(out, group=world_group))
    return float(out[0]) / processes, float(out[1]) / processes


def measure_all(processes: int, groups: dict, world_group, device: torch.device, tick=lambda what: None,
                quick: bool = False) -> dict[tuple[tuple[int, ...], int, bool], tuple[float, float]]:
    """(shape, group size, sequence parallel) -> (layer seconds, twin seconds) for every calibration shape,
    TP group size of the section and form (with and without sequence parallelism; collective); ``quick``:
    each for a quarter of the time (noisier). Both forms are timed even then: one form's wait per collective
    does not stand for the other's."""
    out: dict[tuple[tuple[int, ...], int, bool], tuple[float, float]] = {}
    for shape in shapes.TP_CALIBRATION_BLOCKS:
        tokens = f"{shape[0]}x{shape[1]}"
        for g in group_sizes(processes):
            for sp in (False, True):
                out[(shape, g, sp)] = measure(shape, processes, g, sp, groups[(processes, g)], world_group, device,
                                              BUDGET_S / 4 if quick else BUDGET_S)
                tick(f"tensor-parallel layer ({tokens} tokens) over {g} of {processes} processes"
                     f"{' (SP)' if sp else ''}")
    return out
