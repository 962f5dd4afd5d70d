"""ParallelContext: the device mesh, process groups and rank coordinates of one layout."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from plait.distributed.collectives import collective
from plait.distributed.default_group import DEFAULT_TIMEOUT_S, default_device, ensure_default_group
from plait.distributed.environment import env_int
from plait.errors import ConfigError, rank_list
from plait.parallel_config import ParallelConfig


@dataclass
class ParallelContext:
    """Everything a parallel module needs to know about where it runs. Passed explicitly, never global.

    A context from ``plait.init`` owns the process groups it made; ``close()`` (or leaving ``with plait.init(...)
    as ctx:``) destroys them. Each Gloo group keeps threads on every member rank until it is destroyed and no
    Python object refers to it any more, so a program that calls ``plait.init`` repeatedly closes each context
    once done with it. The default (world) group stays, and a context made around groups it was handed
    (``tp_group_context``) destroys none of them.
    """

    config: ParallelConfig  # resolved: dp known, tp*cp*pp*dp == world_size
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    _groups: dict[str, ProcessGroup] = field(default_factory=dict, repr=False)
    _owned: list[ProcessGroup] = field(default_factory=list, repr=False)  # made for this context: close() ends them
    _closed: bool = field(default=False, repr=False)

    # global rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank  (TP innermost, then CP, DP, PP;
    # with cp = 1: (pp_rank * dp + dp_rank) * tp + tp_rank). CP sits next to TP, as in Megatron-LM, so that the
    # attention's K/V exchange stays on near links when TP does not fill a node.
    @property
    def tp_size(self) -> int:
        return self.config.tp

    @property
    def cp_size(self) -> int:
        return self.config.cp

    @property
    def pp_size(self) -> int:
        return self.config.pp

    @property
    def dp_size(self) -> int:
        return self.config.dp

    @property
    def ep_size(self) -> int:
        return self.config.ep

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp_size) % self.cp_size

    @property
    def dp_rank(self) -> int:
        return (self.rank // (self.tp_size * self.cp_size)) % self.dp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp_size * self.cp_size * self.dp_size)

    @property
    def dp_cp_size(self) -> int:
        """Ranks of a stage with this TP coordinate that hold the same weights and see different tokens."""
        return self.dp_size * self.cp_size

    # Expert parallelism lives in the dp x cp x tp plane of a pipeline stage: plane index
    # q = (dp_rank*cp + cp_rank)*tp + tp_rank (the rank within its stage), EP groups are runs of ep consecutive
    # q; ranks with the same ep_rank (q mod ep) form the expert-data-parallel group (dp*cp*tp/ep ranks holding
    # the same experts). With expert_tp (Megatron-LM's expert tensor parallelism) EP groups are runs of ep
    # consecutive d = dp_rank*cp + cp_rank with the same tp_rank: ep_rank = d mod ep, and the expert-data-
    # parallel group (dp*cp/ep ranks) holds the same shards of the same experts.
    @property
    def expert_tp(self) -> bool:
        """Whether each expert is split over the TP group (``plait.init(..., expert_tp=True)``, tp > 1)."""
        return self.config.expert_tp

    @property
    def ep_rank(self) -> int:
        data = self.dp_rank * self.cp_size + self.cp_rank
        if self.expert_tp:
            return data % self.ep_size
        return (data * self.tp_size + self.tp_rank) % self.ep_size

    @property
    def expert_dp_size(self) -> int:
        return self.dp_cp_size * (1 if self.expert_tp else self.tp_size) // self.ep_size

    def global_rank(self, tp_rank: int | None = None, dp_rank: int | None = None,
                    pp_rank: int | None = None, cp_rank: int | None = None) -> int:
        """Global rank of the given coordinates (defaults: this rank's own)."""
        t = self.tp_rank if tp_rank is None else tp_rank
        c = self.cp_rank if cp_rank is None else cp_rank
        d = self.dp_rank if dp_rank is None else dp_rank
        p = self.pp_rank if pp_rank is None else pp_rank
        return ((p * self.dp_size + d) * self.cp_size + c) * self.tp_size + t

    def replica_ranks(self, dp_rank: int) -> list[int]:
        """Global ranks of data-parallel replica ``dp_rank`` (its tp, cp and pipeline ranks), ascending."""
        return sorted(self.global_rank(tp_rank=t, cp_rank=c, dp_rank=dp_rank, pp_rank=p) for p in range(self.pp_size)
                      for c in range(self.cp_size) for t in range(self.tp_size))

    @property
    def tp_group(self) -> ProcessGroup | None:
        return self._group("tp")

    @property
    def pp_group(self) -> ProcessGroup | None:
        return self._group("pp")

    @property
    def dp_group(self) -> ProcessGroup | None:
        return self._group("dp")

    @property
    def cp_group(self) -> ProcessGroup | None:
        """The context-parallel group: ranks that split the same sequences (None when cp=1)."""
        return self._group("cp")

    @property
    def dp_cp_group(self) -> ProcessGroup | None:
        """The dp x cp group over which dense gradients are reduced (the DP group when cp=1)."""
        return self._group("dp_cp", "dp")

    @property
    def ep_group(self) -> ProcessGroup | None:
        """The expert-parallel group (None when ep=1)."""
        return self._group("ep")

    @property
    def expert_dp_group(self) -> ProcessGroup | None:
        """Ranks of this stage holding the same experts (expert gradients are summed over it)."""
        return self._group("edp", "dp_cp", "dp")

    @property
    def world_group(self) -> ProcessGroup | None:
        return self._group("world")

    @property
    def p2p_group(self) -> ProcessGroup | None:
        """The group pipeline messages travel on (its ranks are the global ranks): the default group under
        Gloo; under NCCL a Gloo group over the same ranks, the messages staged through host memory. NCCL
        matches a pair's messages in posting order and ignores tags, and a send waits on the same stream as the
        receives behind it; plait's pipeline posts receives early and matches them by tag, which only Gloo
        honours (docs/runtime.md, "The GPU path")."""
        return self._group("p2p", "world")

    def check_open(self) -> None:
        """Raise ConfigError if this context is closed (``close()``): local, no collective, so a ParallelModel or
        a decoder that calls it first refuses on every rank alike before its first collective."""
        if self._closed:
            raise ConfigError(f"this ParallelContext ({self.describe()}) is closed: its process groups are "
                              "destroyed; make a new one with plait.init(...)")

    def _group(self, *names: str) -> ProcessGroup | None:
        """The first of ``names`` this context has a group for (None if none)."""
        self.check_open()
        for name in names:
            group = self._groups.get(name)
            if group is not None:
                return group
        return None

    def new_group(self, ranks: list[int]) -> ProcessGroup | None:
        """A process group over the global ``ranks`` that ``close()`` destroys with this context's own; every rank
        of the world calls it, in the same order (``torch.distributed.new_group``). None on a rank not in it."""
        self.check_open()
        group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=self.timeout_s))
        if self.rank not in ranks:
            return None
        self._owned.append(group)
        return group

    def close(self) -> None:
        """Destroy the process groups this context made (not the default group, not groups it was handed) and
        drop its mesh. Every rank calls it once its last collective on them has returned; destroying is local,
        no collective runs. Closing again does nothing; using a closed context's groups raises ConfigError."""
        if self._closed:
            return
        self._closed = True
        owned, self._owned, self._groups, self.mesh = self._owned, [], {}, None
        if not dist.is_initialized():  # the default group's destruction took every group with it
            return
        for group in owned:
            if group is not dist.group.WORLD:
                try:
                    dist.destroy_process_group(group)
                except ValueError:  # destroyed already, by its user
                    pass

    def __enter__(self) -> ParallelContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_timeout(self, seconds: float) -> None:
        """From now on, a collective of this rank on the default group, one of this context's groups or one made
        by ``new_group`` fails after waiting ``seconds`` (this rank's setting only: every rank sets its own)."""
        # torch's private _set_pg_timeout: it sets the default timeout of each backend of a group, Gloo's and
        # NCCL's alike. The public ProcessGroup.set_timeout forwards to Backend::setTimeout, which c10d's
        # ProcessGroupNCCL does not override (it raises "Backend nccl does not support setting timeout"), so it
        # serves Gloo only; torch offers no other public way to change a live group's timeout.
        # tests/test_pipeline_faults.py checks that a lowered timeout ends a collective a peer never joins.
        from torch.distributed.distributed_c10d import _set_pg_timeout

        self.check_open()
        self.timeout_s = seconds
        for group in {id(g): g for g in [dist.group.WORLD, *self._groups.values(), *self._owned]}.values():
            _set_pg_timeout(datetime.timedelta(seconds=seconds), group)

    def pp_peer(self, pp_rank: int) -> int:
        """Global rank of the rank holding pipeline stage ``pp_rank`` with this rank's tp/cp/dp coordinates."""
        return self.global_rank(pp_rank=pp_rank)

    def describe(self) -> str:
        ep = f", ep {self.ep_rank}/{self.ep_size}" if self.ep_size > 1 else ""
        ep += ", experts split over tp" if self.expert_tp else ""
        cp = f", cp {self.cp_rank}/{self.cp_size}" if self.cp_size > 1 else ""
        return (f"rank {self.rank}/{self.world_size} (tp {self.tp_rank}/{self.tp_size}{cp}, "
                f"pp {self.pp_rank}/{self.pp_size}, dp {self.dp_rank}/{self.dp_size}{ep})")


def init(tp: int = 1, pp: int = 1, dp: int = -1, ep: int = 1, *, cp: int = 1, expert_tp: bool = False,
         timeout_s: float | None = None, config: ParallelConfig | None = None) -> ParallelContext:
    """Create a ParallelContext for the layout ``tp x cp x pp x dp`` (TP innermost, then CP, DP, PP).

    ``config`` (a ParallelConfig) replaces the size keywords; its other fields (schedule, micro-batches, ...) then
    become the defaults of ``plait.parallelize(model, ctx)``. Reads torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) and initialises the default process group if needed (NCCL with CUDA, otherwise Gloo;
    destroyed at the program's exit). The layout is validated before any collective; then every rank of the world
    agrees on it (each calls plait.init with the same layout, or all are refused alike). Calling it again with
    another layout returns a new context with new groups; ``ctx.close()``, or leaving ``with plait.init(...) as
    ctx:``, destroys them once the program is done with that context. ``expert_tp=True`` splits every expert over
    the TP group (plait.experts.layer); then ep must divide dp·cp. ``cp`` ranks split every sequence
    (plait.context_parallel); each is handed the same full rows.
    """
    if config is None:
        config = ParallelConfig(tp=tp, pp=pp, dp=dp, ep=ep, cp=cp, expert_tp=expert_tp)
    elif (tp, pp, dp, ep, cp, expert_tp) != (1, 1, -1, 1, 1, False):
        raise ConfigError("plait.init: pass the layout either as config=ParallelConfig(...) or as tp/pp/dp/ep/cp/"
                          "expert_tp keywords, not both")
    timeout = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    world = dist.get_world_size() if dist.is_initialized() else env_int("WORLD_SIZE", 1)
    try:
        config = config.resolve(world)
    except ConfigError:
        if dist.is_initialized() or "WORLD_SIZE" in os.environ:
            raise
        sizes = ", ".join(f"{k}={getattr(config, k)}" for k in ("tp", "pp", "dp", "cp")
                          if getattr(config, k) not in (1, -1))
        n = config.tp * config.cp * config.pp * max(config.dp, 1)
        raise ConfigError(f"plait.init({sizes}) needs {'a multiple of ' if config.dp == -1 else ''}{n} processes, "
                          "but this process was not started by a launcher (WORLD_SIZE is not set) and is a world of "
                          f"1: run the script under torchrun, e.g. torchrun --nproc-per-node {n} script.py") from None
    ensure_default_group(timeout)
    _agree_on_layout(config)
    device = default_device()
    mesh = init_device_mesh(device.type, (config.pp, config.dp, config.cp, config.tp),
                            mesh_dim_names=("pp", "dp", "cp", "tp"))
    owned = mesh.get_all_groups()  # one group a dimension, size-1 ones included (the world's own where it spans it)
    groups: dict[str, ProcessGroup] = {name: mesh.get_group(name) for name in ("pp", "dp", "tp")}
    if config.cp > 1:
        groups["cp"] = mesh.get_group("cp")
        flat = init_device_mesh(device.type, (config.pp, config.dp * config.cp, config.tp),
                                mesh_dim_names=("pp", "dp_cp", "tp"))  # CP next to DP: one dimension of both
        groups["dp_cp"] = flat.get_group("dp_cp")
        owned += flat.get_all_groups()
    assert dist.group.WORLD is not None  # the default group exists from here on
    groups["world"] = dist.group.WORLD
    if config.pp > 1 and dist.get_backend() != "gloo":  # every rank creates it, in the same order
        groups["p2p"] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        owned.append(groups["p2p"])
    expert_groups, expert_owned = _expert_groups(config, device)
    groups.update(expert_groups)
    mine = {id(g): g for g in owned + expert_owned if g is not dist.group.WORLD}  # each once, the world's not
    return ParallelContext(config=config, rank=dist.get_rank(), world_size=world, device=device,
                           mesh=mesh, timeout_s=timeout, _groups=groups, _owned=list(mine.values()))


def _agree_on_layout(config: ParallelConfig) -> None:
    """Every rank of the world passes here with its layout: a rank that does not call plait.init keeps the others
    here until the default group's timeout (a CommTimeoutError naming plait.init), not at the model's first
    collective; ranks that asked for different layouts are refused alike, before any group of the layout is made."""
    if (world := dist.get_world_size()) == 1:
        return
    mine = (config.tp, config.cp, config.pp, config.dp, config.ep, config.expert_tp)
    layouts: list[Any] = [None] * world
    collective("plait.init's start-up agreement (every rank of the world calls plait.init, with the same layout)",
               None, lambda: dist.all_gather_object(layouts, mine))
    if len(set(layouts)) > 1:
        names = ("tp", "cp", "pp", "dp", "ep", "expert_tp")
        ranks = {layout: [r for r, other in enumerate(layouts) if other == layout] for layout in layouts}
        said = "; ".join(f"global ranks {rank_list(rs)}: "
                         + ", ".join(f"{n}={v}" for n, v in zip(names, layout, strict=True))
                         for layout, rs in ranks.items())
        raise ConfigError(f"plait.init: the ranks of the world asked for different layouts ({said}); every rank "
                          "calls plait.init with the same tp/cp/pp/dp/ep/expert_tp")


def tp_group_context(group: ProcessGroup, device: torch.device, timeout_s: float | None = None) -> ParallelContext:
    """A context of one tensor-parallel ``group`` of consecutive ranks and nothing else (no pipeline, no
    data-parallel group): for a tool that times a tensor-parallel block on its own while other groups do
    the same, as ``plait calibrate`` does. Its ``world_size`` is the group's size."""
    ranks = dist.get_process_group_ranks(group)
    tp = len(ranks)
    if ranks != list(range(ranks[0], ranks[0] + tp)) or ranks[0] % tp:
        raise ConfigError(f"tp_group_context: ranks {ranks} are not a run of {tp} consecutive ranks starting at a "
                          f"multiple of {tp} (how plait lays out TP groups)")
    config = ParallelConfig(tp=tp, pp=1, dp=1).resolve(tp)
    return ParallelContext(config=config, rank=dist.get_rank(), world_size=tp, device=device,
                           timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s,
                           _groups={"tp": group})


def _expert_groups(layout: ParallelConfig,
                   device: torch.device) -> tuple[dict[str, ProcessGroup], list[ProcessGroup]]:
    """The EP and expert-DP groups (every rank creates them, in the same order; none for tp = ep = 1), and every
    group their mesh made."""
    if layout.ep == 1 and layout.tp == 1:
        return {}, []
    data = layout.dp * layout.cp
    if layout.expert_tp:  # rank = ((pp·dp·cp/ep + edp)·ep + ep_rank)·tp + tp_rank
        emesh = init_device_mesh(device.type, (layout.pp, data // layout.ep, layout.ep, layout.tp),
                                 mesh_dim_names=("pp", "edp", "ep", "etp"))
    else:
        plane = data * layout.tp
        emesh = init_device_mesh(device.type, (layout.pp, plane // layout.ep, layout.ep),
                                 mesh_dim_names=("pp", "edp", "ep"))
    groups = {"edp": emesh.get_group("edp")}
    if layout.ep > 1:
        groups["ep"] = emesh.get_group("ep")
    return groups, emesh.get_all_groups()
