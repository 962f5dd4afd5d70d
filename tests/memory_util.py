"""Memory measured in tests: what a decoder layer keeps for backward (saved-tensor hooks) against the count of
docs/runtime.md, and the most bytes of tensors alive at once while some code runs (``LiveBytes``)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from plait.memory import SavedTensorMeter
from plait.models import LlamaConfig
from profile_util import synthetic_profile


def saved_bytes(fn, x: torch.Tensor, exclude) -> tuple[int, torch.Tensor]:
    """Bytes autograd saves while ``fn(x)`` runs, each storage once, ``exclude`` (parameters) left out — the
    runtime's own meter (plait.memory.SavedTensorMeter) — and the output.

    A checkpointed region's own saved tensors go through its hooks (not counted: they are recomputed); the
    region's inputs are saved outside it (counted)."""
    meter = SavedTensorMeter(exclude)
    with meter.hooks():
        out = fn(x)
    return meter.live, out


def layer_elements(cfg: LlamaConfig, b: int, s: int, mode: str, kernel: str = "fused", t: int = 1,
                   sp: bool = False) -> int:
    """Elements plait's decoder layer saves for ``b`` sequences of ``s`` tokens on one of ``t`` TP ranks.

    Per token: each RMSNorm keeps its input, 1/rms and the normalised input (2h + 1; on s/t tokens with
    SP); the inputs of the Q/K/V and gate/up projections (h each, whole sequence, replicated; with SP the
    sequence shard, which the backward all-gathers again); the attention core keeps q, k, v, its output (also
    the o_proj input) and one log-sum-exp per head (fused kernel, which shares each KV head among its query
    heads itself) or the a·s softmax probabilities (math kernel, which repeats the KV heads up to the query
    heads first and keeps the repeated k, v; its output is then copied for o_proj); SwiGLU keeps gate,
    silu(gate), up and their product (4f). Selective recomputation keeps only q, k, v of the core, plus the
    o_proj input. The RoPE cos and sin tables add 2·s·hd: the model's layers share one pair
    (plait.models.rotary), so a layer measured alone keeps them, and a rank keeps them once whatever its layers
    and micro-batches. Heads and f are split over t.
    """
    h, f, a, hd = cfg.dim, cfg.ffn_dim, cfg.n_heads, cfg.head_dim
    kv_local = max(cfg.n_kv_heads // t, 1) * hd  # KV heads on this rank (replicated when fewer than t)
    norms = (4 * h + 2) // (t if sp else 1)
    if mode == "selective":
        core = h // t + 2 * kv_local + h // t
    else:
        core = (2 * h // t + 2 * kv_local + a // t) if kernel == "fused" else (4 * h // t + a * s // t)
    return b * s * (norms + 2 * h // (t if sp else 1) + core + 4 * f // t) + 2 * s * hd


def layer_bytes(cfg: LlamaConfig, b: int, s: int, mode: str, kernel: str = "fused", t: int = 1, sp: bool = False,
                dtype: torch.dtype = torch.float32) -> int:
    """``layer_elements`` in bytes. In bf16 each element takes 2 bytes, except what stays float32: each
    RMSNorm's float32 copy of its input and 1/rms (2h + 2 more bytes per token of the norm), and the fused
    kernel's log-sum-exp (2 more bytes per head)."""
    n = layer_elements(cfg, b, s, mode, kernel, t, sp)
    if dtype == torch.float32:
        return 4 * n
    extra = 2 * (2 * cfg.dim + 2) // (t if sp else 1)
    if mode == "none" and kernel == "fused":
        extra += 2 * cfg.n_heads // t
    return 2 * n + b * s * extra


class LiveBytes(TorchDispatchMode):
    """Bytes of the CPU storages created by the tensor operations run inside ``with LiveBytes() as m:`` that are
    still alive, and their peak (``m.peak``). Each storage is counted once, from the op that allocated it until
    it is freed (a finaliser on the storage object, which lives as long as the storage). Storages created
    before entering are not counted, but for those of ``held`` (e.g. the parameters, gradient buffers and
    optimizer state of a step measured whole), counted from the start.

    A census of op outputs: the operations' own scratch space (inside one kernel) is not seen. It sees the
    backward's operations too (on a CPU autograd runs them on the calling thread, under the same mode)."""

    def __init__(self, held: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.alive: dict[int, int] = {}  # id(storage) -> bytes
        for t in held:
            self._count(t)

    def _count(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if id(st) not in self.alive and st.nbytes():
            self.alive[id(st)] = st.nbytes()
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(st, self._freed, id(st))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._count(t)
        return out

    def _freed(self, key: int) -> None:
        self.live -= self.alive.pop(key, 0)


def first_step_memory(tmp_path, model: str, **fields) -> tuple[dict, dict]:
    """``plait train`` of ``model`` (one process, in this one, 2 x 128 tokens) with ``fields``: what
    ``pm.memory_report()`` measured on the first step, and the planner's prediction as --dry-run makes it."""
    import plait
    from plait.cli.predict import memory_rows, predict
    from plait.train import TrainConfig
    from plait.train.loop import build, train_one

    cfg = TrainConfig.from_dict(dict(model=model, seq_len=128, batch_size=2, microbatches=1, steps=1, eval_every=0,
                                     sample_tokens=0, trace_every=0, max_data_mb=0.1, tp=1, pp=1, dp=1,
                                     checkpoint_dir=str(tmp_path / "ck"), cluster="none", **fields))
    with plait.init(1, 1, 1) as ctx:
        run = build(cfg, ctx)
        train_one(run, 0, False)
        measured = run.pm.memory_report()
    (predicted,) = memory_rows(predict(cfg, synthetic_profile(counts=(1,)), 1))
    return measured, predicted


MEMORY_KINDS = ("params", "grads", "optimizer", "activations_peak")
