"""Rank-side checks of context parallelism (4 ranks): the mesh's rank order and groups."""

from __future__ import annotations

import torch.distributed as dist

import plait
from harness import run_checks


def check_mesh(tp: int, cp: int, pp: int, dp: int) -> dict:
    """This rank's coordinates against rank = ((pp·dp + dp_rank)·cp + cp_rank)·tp + tp_rank, and the members of
    its CP and dp×cp groups (every member with this rank's other coordinates)."""
    ctx = plait.init(tp=tp, pp=pp, dp=dp, cp=cp)
    coords = (ctx.tp_rank, ctx.cp_rank, ctx.dp_rank, ctx.pp_rank)
    formula = ((ctx.pp_rank * dp + ctx.dp_rank) * cp + ctx.cp_rank) * tp + ctx.tp_rank
    want_cp = [ctx.global_rank(cp_rank=c) for c in range(cp)]
    want_dcp = [ctx.global_rank(dp_rank=d, cp_rank=c) for d in range(dp) for c in range(cp)]
    cp_members = dist.get_process_group_ranks(ctx.cp_group) if ctx.cp_group is not None else [ctx.rank]
    return {"rank": ctx.rank, "formula": formula, "coords": coords,
            "cp_group_ok": cp_members == want_cp, "dp_cp_group_ok":
                dist.get_process_group_ranks(ctx.dp_cp_group) == want_dcp if dp * cp > 1 else True,
            "pp_peer_ok": all(ctx.pp_peer(p) == ctx.global_rank(pp_rank=p) for p in range(pp))}


MESHES = {"tp1cp4": (1, 4, 1, 1), "tp2cp2": (2, 2, 1, 1), "cp2dp2": (1, 2, 1, 2), "cp2pp2": (1, 2, 2, 1),
          "tp2dp2": (2, 1, 1, 2)}


def rank_main() -> dict:
    checks = [(f"mesh/{name}", lambda s=sizes: check_mesh(*s)) for name, sizes in MESHES.items()]
    return run_checks(checks)
