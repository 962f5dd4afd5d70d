"""The cost model of catalogue GPUs: datasheet peaks at efficiencies fitted on published runs, ring formulas for
collectives, Korthikanti et al.'s activation count (Megatron-LM's kernels, 16-bit).

What one layer costs: its FLOPs (``timing.layer_forward_flops``) at ``peak · matmul_efficiency``, at each
pass's share of that after its GEMMs' tile and wave quantization where the GPU's cuBLAS has it, plus its GEMMs'
operands and results through HBM (``plan.gemm``) and its element-wise kernels' HBM traffic; backward the data-
and weight-gradient GEMMs (each the forward's FLOPs and bytes) and twice the element-wise traffic; the TP
all-reduces (or SP's gathers and scatters) and MoE's all-to-alls on ring formulas over the link the group spans
(NVLink inside a node; across nodes the NICs its members in a node have: ``group_link``). The fit and its
errors on published runs, each source held out: ``plan.validation``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING

from plait.plan import eager, experts, tp_comm
from plait.plan.accumulation import RUNTIME_ACCUMULATION
from plait.plan.attention import efficiency as attention_efficiency
from plait.plan.attention import window_share
from plait.plan.catalogue import GPU, LINK_EFFICIENCY, Link
from plait.plan.config import TE_OVERLAP_SMS
from plait.plan.costs import Blocks, Span, StageCosts
from plait.plan.documents import DocumentLengths, MaskedAttention, masked_attention
from plait.plan.eager import ELEMENTWISE
from plait.plan.gemm import gemm_seconds, gemm_speed, operand_bytes, passes
from plait.plan.host import census
from plait.plan.host.costs import eager_activations
from plait.plan.memory import ACTIVATION_BYTES, ActivationModel, activation_bytes_per_layer, zero3_working
from plait.plan.optimizers import OPTIMIZERS, RUNTIME_OPTIMIZER
from plait.plan.timing import head_forward_flops, head_gemm, layer_forward_flops, layer_gemms, recomputed_gemms

if TYPE_CHECKING:
    from plait.plan.cluster import Cluster
    from plait.plan.config import Layout
    from plait.plan.model import Model

# The constants of this model ride on the catalogue entry (``catalogue.GPU``), fitted on the published runs
# (``plan.published``; leave-one-source-out: ``plan.validation``):
# - ``matmul_efficiency``: the ceiling large GEMMs reach; each GEMM also moves its operands and result through HBM
#   at ``memory_bandwidth`` (``gemm_traffic``: narrow GEMMs move more bytes per FLOP), and where the GPU's cuBLAS
#   quantizes (``GPU.tile_quantization``) each GEMM of a pass keeps the share of the ceiling its tiles leave after
#   tile and wave quantization on the GPU's SMs (``gemm_quantization``);
# - ``elementwise_traffic``: element-wise kernels (norms, softmax, dropout, residual adds, activations) move about
#   this many times the layer's stored activation bytes through HBM per forward pass;
# Fused attention (``Cluster(flash_attention=...)``) runs QK^T and AV on the causal half of the s×s square
# (``FLASH_CAUSAL``), forward and backward, at the share of peak its kernel's published benchmark reaches at that
# sequence length and head dimension (``plan.attention.efficiency``: FlashAttention-2 on the A100 from 32% at 512
# tokens to 61% at 16k, head dimension 128; on the H100 only 16-33%, where cuDNN's and FlashAttention-3's Hopper
# kernels reach 22-56%), and never writes the scores to HBM. GPUs without published figures take
# ``GPU.flash_efficiency`` (0.5). Not fitted.
# FlashAttention's backward recomputes the scores from Q and K: 5 matmuls of the forward's 2 (Dao et al. 2022,
# Algorithm 4), 2.5 times the forward's attention FLOPs.
FLASH_BACKWARD = 2.5
# A causal flash kernel computes only the key blocks on and below the diagonal: about half of the s×s square the
# FLOP count charges (Dao 2023, FlashAttention-2, §3.1.1: causal masking skips the blocks above it).
FLASH_CAUSAL = 0.5
def ring_allreduce(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce: each rank moves 2(n-1)/n of the tensor, in 2(n-1) latency-bound steps
    (Patarasuk & Yuan 2009; Thakur et al. 2005)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / (link.bandwidth * LINK_EFFICIENCY) + 2 * (n - 1) * link.latency


def ring_allgather(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) of a tensor of ``nbytes`` in total: (n-1)/n of it."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / (link.bandwidth * LINK_EFFICIENCY) + (n - 1) * link.latency


Quantization = tuple[tuple[float, float, float], tuple[float, float, float]]
UNQUANTIZED: Quantization = ((1.0, 1.0, 1.0), (1.0, 1.0, 1.0))


@lru_cache(maxsize=4096)
def _quantization(sms: int, model: Model, layout: Layout) -> Quantization:
    return passes(layer_gemms(model, layout), sms), passes((head_gemm(model, layout),), sms)


def gemm_quantization(gpu: GPU, model: Model, layout: Layout) -> Quantization:
    """(layer, head) shares of the matmul speed their GEMMs keep after tile and wave quantization on ``gpu``'s
    SMs (``plan.gemm``; the GEMMs' shapes: ``timing.layer_gemms``, ``timing.head_gemm``), each (forward, data
    gradient, weight gradient); all 1.0 for a GPU whose cuBLAS is not costed quantized (``GPU.tile_quantization``)
    or without an SM count. The attention core's batched GEMMs (unfused softmax) and the overlapped collectives'
    partial GEMMs (``tp_comm.userbuffers``) are not quantized."""
    return _quantization(gpu.sms, model, layout) if gpu.tile_quantization else UNQUANTIZED


@lru_cache(maxsize=4096)
def _traffic(model: Model, layout: Layout) -> tuple[float, float]:
    return operand_bytes(layer_gemms(model, layout)), operand_bytes((head_gemm(model, layout),))


def gemm_traffic(gpu: GPU, model: Model, layout: Layout) -> tuple[float, float]:
    """(layer, head) seconds their GEMMs' operands and results take through ``gpu``'s HBM in each pass (forward,
    data gradient, weight gradient alike: ``plan.gemm.operand_bytes``), on top of their FLOPs at ``gemm_speed``. The
    unfused attention core's score traffic is the element-wise term's."""
    layer, head = _traffic(model, layout)
    return layer / gpu.memory_bandwidth, head / gpu.memory_bandwidth


@dataclass(frozen=True)
class GpuCosts:
    """The ``CostModel`` of a cluster of catalogue GPUs (``Cluster(gpu, n_gpus, ...)``)."""

    cluster: Cluster = field(repr=False, compare=False)
    #: Megatron-LM's distributed optimizer gathers the bf16 weights
    weight_gather_bytes: int = 2

    @property
    def gpu(self) -> GPU:
        return self.cluster.gpu

    def collective(self, op: str, nbytes: float, n: int, span: int | None = None) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        link = self.group_link(n, span or n)
        if op == "all_reduce":
            return ring_allreduce(nbytes, n, link)
        if op in ("all_gather", "reduce_scatter"):
            return ring_allgather(nbytes, n, link)
        if op == "all_to_all":
            return nbytes * (n - 1) / n / (link.bandwidth * LINK_EFFICIENCY) + (n - 1) * link.latency
        return nbytes / (link.bandwidth * LINK_EFFICIENCY) + link.latency  # p2p

    def group_link(self, n: int, span: int) -> Link:
        """The link a collective over ``n`` ranks spread over ``span`` consecutive ranks runs at, per rank.
        Inside a node: NVLink. Across nodes every GPU has its own NIC (a rail: 8 x HDR on DGX A100, 8 x NDR on
        DGX H100), and NCCL spreads a ring's channels over the NICs of the node: a group with k members in a node
        moves its inter-node traffic through those k NICs, k times one NIC's bandwidth per rank, up to NVLink's
        (the groups of the other ranks of the node use the other NICs at the same time), and up to the link's
        ``ring_bandwidth`` where NCCL routes a ring through fewer NICs than that."""
        g = self.cluster.gpus_per_node
        link = self.cluster.link(span)
        if span <= g:
            return link
        members = max(1, min(n, g * n // span))
        bandwidth = min(members * link.bandwidth, self.gpu.intra.bandwidth)
        if link.ring_bandwidth:
            bandwidth = min(bandwidth, link.ring_bandwidth)
        return Link(link.name, bandwidth, link.latency)

    def _tp_comm_per_layer(self, model: Model, layout: Layout, tokens: float,
                           overlap: tuple[int, int] | None = None, sp_async: bool = False) -> tuple[float, float]:
        """Exposed collectives of one layer's (forward, backward): 2 all-reduces of [b, s, h] each way (TP,
        Shoeybi et al. 2019) or 2 all-gathers + 2 reduce-scatters with SP (same volume; ``overlap``, the SMs of the
        pipelined scatters, with SP: ``tp_comm.userbuffers``; ``sp_async``, a dense layer's column-parallel
        backward beside its GEMMs: ``tp_comm.async_backward``), an MoE layer's own in place of the MLP's
        (``experts.tp_gathers``); MoE all-to-all dispatch and combine (``experts.dispatch``); the
        context-parallel K/V exchange (``_cp_comm_per_layer``)."""
        act = tokens * model.hidden * 2  # bf16 [b, s/cp, h]
        t, link = layout.tp, self.cluster.link
        if overlap is not None and layout.sequence_parallel:
            f, b = tp_comm.userbuffers(self.gpu, model, layout, tokens, ring_allgather(act, t, link(t)), overlap)
        else:
            attention = ring_allreduce(act, t, link(t))
            mlp_f = mlp_b = attention
            if model.is_moe:
                mlp_f, mlp_b = (n * ring_allgather(act, t, link(t)) for n in experts.tp_gathers(layout))
            f, b = attention + mlp_f, attention + mlp_b
            if sp_async and layout.sequence_parallel and not model.is_moe:
                b = tp_comm.async_backward(self.gpu, model, layout, tokens, ring_allgather(act, t, link(t)))
        cp_f, cp_b = self._cp_comm_per_layer(model, layout, tokens)
        f, b = f + cp_f, b + cp_b
        if model.is_moe and layout.ep > 1:
            e = layout.ep
            sent, span = experts.dispatch(model, layout, act)
            a2a = sent * (e - 1) / e / (link(span).bandwidth * LINK_EFFICIENCY)
            dispatch_combine = 2 * (a2a + (e - 1) * link(span).latency)
            f, b = f + dispatch_combine, b + dispatch_combine
        return f, b

    def _attention_core(self, model: Model, layout: Layout, flops: float,
                        masked: MaskedAttention | None = None) -> tuple[float, float]:
        """Seconds of the attention core's (QK^T and AV) forward and backward over ``flops``, counted on the whole
        s×s square as ``layer_forward_flops`` counts them. A fused kernel (``Cluster(flash_attention=...)``) runs
        the causal half (``FLASH_CAUSAL``) at its published share of peak at this sequence length per CP rank and
        head dimension (``plan.attention.efficiency``), its backward ``FLASH_BACKWARD`` times that work; the
        unfused softmax runs at the GEMM speed, its backward twice the forward.
        A sliding window (``Model.sliding_window``) on the layers that take one (``Model.window_layer_share``; none
        where the window spans the sequence): plait's layer hands it to SDPA as an explicit mask, which the flash
        backend does not take, so at cp = 1 the fused kernel computes those layers' whole square, masked blocks
        included (at the same share of peak: no published figures); context parallelism's blockwise attention
        skips the key blocks no query of a tile sees, so under cp > 1 their causal half shrinks to the pairs the
        window keeps (``plan.attention.window_share``).
        Document masking (``masked``, ``plan.documents.masked_attention``): each document alone, the documents'
        share of the work at the kernel's speed for their length; the mask path, the whole square computed (as
        with a window's mask), and its additive mask read through HBM in the forward and again in the backward."""
        gpu = self.gpu
        masked = masked or MaskedAttention(None, 1.0, model.seq_len / layout.cp, 0.0)
        flops, mask = flops * masked.share, masked.mask / gpu.memory_bandwidth
        if not self.cluster.flash_attention:
            forward = flops / gemm_speed(gpu)
            return forward + mask, 2 * forward + mask
        kernel = attention_efficiency(gpu, self.cluster.attention, masked.seq, model.head_dim)
        windowed = model.window_layer_share
        if masked.path == "mask":
            computed = 1.0
        elif layout.cp == 1:
            computed = windowed + (1 - windowed) * FLASH_CAUSAL
        else:
            computed = FLASH_CAUSAL * (windowed * window_share(model.seq_len, model.sliding_window) + 1 - windowed)
        forward = flops * computed / (gpu.peak_flops * kernel)
        return forward + mask, FLASH_BACKWARD * forward + mask

    def _cp_comm_per_layer(self, model: Model, layout: Layout, tokens: float) -> tuple[float, float]:
        """What one layer's context-parallel K/V exchange leaves exposed, (forward, backward).

        allgather: K and V of the whole sequence gathered over the CP group before the attention core, exposed;
        the backward reduce-scatters their gradients, the same volume.

        ring: Transformer Engine's ``AttnFuncWithCPAndKVP2P`` (NVIDIA/TransformerEngine
        transformer_engine/pytorch/attention.py at 3b2a7b00, the commit NVIDIA/NeMo's requirements/manifest.json
        pins at d2b21556), which Megatron-Core's default ``cp_comm_type`` "p2p" runs, in cp steps. Forward: step
        i waits for K/V block i, posts the send of block i to the previous rank and the receive of block i+1
        from the next, then runs the attention on block i, so the cp-1 transfers each run beside one step's
        attention. Backward: step i posts the send of block i with the partial dK/dV it carries (block 0: K/V
        alone; the last step: dK/dV alone; between: both, twice the bytes), runs the attention backward on block
        i and waits for the transfer before adding its dK/dV: cp transfers, each beside one step's backward.
        With the causal load balance (the sequence in 2·cp chunks, rank r holding chunks r and 2cp-1-r) every
        step computes half of the block's (S/cp)² square: the local causal one, both query chunks against the
        earlier key chunk, or the later query chunk against both key chunks. So each step takes 1/cp of the
        attention the layer is charged (``_attention_core``); a transfer shows only beyond it."""
        c, t = layout.cp, layout.tp
        if c == 1:
            return 0.0, 0.0
        kv = max(model.kv_heads / t, 1.0) * model.head_dim  # KV heads per TP rank (one when they are replicated)
        block = tokens * 2 * kv * 2  # bf16 K and V of this rank's tokens
        if layout.cp_comm == "allgather":
            gather = self.collective("all_gather", block * c, c, span=t * c)
            return gather, gather
        step_f, step_b = self._attention_core(model, layout, 4 * tokens * model.seq_len * model.q_width / t / c)
        one, two = (self.collective("p2p", n * block, 2, span=t * c) for n in (1, 2))
        forward = (c - 1) * max(0.0, one - step_f)
        backward = 2 * max(0.0, one - step_b) + (c - 2) * max(0.0, two - step_b)
        return forward, backward

    def blocks(self, model: Model, layout: Layout, precision: str, tp_overlap: bool = False,
               overlap_sms: tuple[int, int] = TE_OVERLAP_SMS, elementwise: str = ELEMENTWISE[0],
               sp_async: bool = False, early_stop: bool = True, documents: DocumentLengths | None = None) -> Blocks:
        """A layer: FLOPs at the fitted efficiency plus its GEMMs' and element-wise kernels' HBM traffic, its TP
        collectives (what of them ``tp_overlap`` leaves exposed, its pipelined scatters on ``overlap_sms`` SMs:
        ``tp_comm.userbuffers``; ``sp_async``: ``tp_comm.async_backward``) and what recomputation redoes, on the
        busiest GPU of an EP group (its experts' GEMMs and all-to-all bytes at ``experts.received`` times
        balanced routing's); the head: its FLOPs and its GEMM's traffic. The embedding's lookup is free. The
        attention core runs as ``_attention_core`` times it; with fused flash attention its backward recomputes
        the scores (so selective recomputation redoes nothing more) and its s×s scores never reach HBM.
        ``elementwise`` (``Training.elementwise``): "fused", the fitted ``elementwise_traffic`` per forward and
        twice it per backward; "plait-eager", plait's own kernels of the layer and of the head and loss counted
        by ``plan.eager``, at this GPU's measured rates where it has them (``_eager``; the unfused core's softmax
        over the scores keeps the fitted term), and the backward's all-gathers of the SP regions' inputs again
        (``census.Local.regathers``: two a dense layer, none under full recomputation), exposed like its other TP
        collectives. ``early_stop`` (``Training.recompute_early_stop``): full recomputation re-runs a layer's
        forward up to its last saved tensor only (``_not_recomputed``). ``documents`` (``Training.documents``): the
        attention core under document masking (``_attention_core``; the unfused core's scores and their softmax at
        the documents' share)."""
        gpu, t = self.gpu, layout.tp
        tokens = layout.microbatch_size * model.seq_len / layout.cp
        speed = gemm_speed(gpu)
        flops = layer_forward_flops(model, tokens, model.seq_len) / t + experts.excess_flops(model, layout, tokens)
        attention = 4 * tokens * model.seq_len * model.hidden / t  # QK^T and AV (Narayanan et al. 2021, eq. 2)
        tp, tp_b = self._tp_comm_per_layer(model, layout, tokens, overlap_sms if tp_overlap else None, sp_async)
        masked = masked_attention(documents, model, layout, ACTIVATION_BYTES[precision])
        core, core_b = self._attention_core(model, layout, attention, masked)
        (qf, qd, qw), (hf, hd, hw) = gemm_quantization(gpu, model, layout)
        g, hg = gemm_traffic(gpu, model, layout)
        dense = (flops - attention) / speed
        kept = activation_bytes_per_layer(model, replace(layout, recompute="selective"))  # no scores
        own = elementwise == "plait-eager"
        if own:  # plait's runtime gathers each SP region's input again in the backward (tensor_parallel.regather)
            tp_b += census.local(model, layout).regathers * ring_allgather(tokens * model.hidden * 2, t,
                                                                           self.cluster.link(t))
            traffic, traffic_b = self._eager(eager.layer_kernels(model, layout, precision))
            head_f, head_b = self._eager(eager.head_kernels(model, layout, precision))
        else:
            traffic = gpu.elementwise_traffic * kept / gpu.memory_bandwidth
            traffic_b, head_f, head_b = 2 * traffic, 0.0, 0.0
        if self.cluster.flash_attention:
            f = dense / qf + g + core + traffic
            b = dense / qd + dense / qw + 2 * g + core_b + traffic_b
            w = dense / qw + g
            recompute = f + tp if layout.recompute == "full" else 0.0
        else:
            stored = activation_bytes_per_layer(model, replace(layout, recompute="none"))
            softmax = stored - kept if own else stored  # the scores' element-wise traffic stays the fitted term
            rest = (attention / speed + gpu.elementwise_traffic * softmax / gpu.memory_bandwidth) * masked.share + \
                masked.mask / gpu.memory_bandwidth
            own_f, own_b = (traffic, traffic_b) if own else (0.0, 0.0)
            f = dense / qf + g + rest + own_f
            b, w = dense / qd + dense / qw + 2 * g + 2 * rest + own_b, dense / qw + g + rest
            if layout.recompute == "full":
                recompute = f + tp
            elif layout.recompute == "selective" and layout.cp == 1:
                # The checkpointed core runs again whole: QK^T, the softmax, its dropout and AV (Korthikanti et
                # al. 2022, §5; NVIDIA/NeMo v1.11.0 transformer.py ParallelAttention._checkpointed_attention_forward
                # recomputes CoreAttention.forward: baddbmm, FusedScaleMaskSoftmax, attention_dropout, bmm), so
                # its GEMMs and the element-wise kernels over its s×s scores, the bytes selective recomputation
                # does not keep; context parallelism's core keeps no probabilities and replaces the checkpoint
                recompute = core + gpu.elementwise_traffic * (stored - kept) / gpu.memory_bandwidth
            else:
                recompute = 0.0
        head = head_forward_flops(model, tokens) / layout.tp / speed
        head_r = head / hf + hg + head_f
        if layout.recompute == "full" and early_stop:
            recompute -= self._not_recomputed(model, layout, tokens, tp_overlap)
            norm = eager.rms_norm(eager.widths(model, layout)[0], eager.dtype_bytes(precision))  # the final norm's
            head_r = self._eager(norm)[0] if own else 0.0
        return Blocks(StageCosts(f, b, w, tp, tp_b, recompute, 0.0, 1), StageCosts(),
                      StageCosts(head / hf + hg + head_f, head / hd + head / hw + 2 * hg + head_b, head / hw + hg,
                                 recompute=head_r if layout.recompute == "full" else 0.0))

    def _eager(self, kernels: list[eager.Kernel]) -> tuple[float, float]:
        """(forward, backward) seconds of plait's eager ``kernels``: each kind at this GPU's measured rate, the
        others at its measured shares of the bandwidth (``GPU.elementwise_rates``); all at the bandwidth where
        nothing was measured."""
        return eager.seconds(kernels, self.gpu.memory_bandwidth, self.gpu.elementwise_rates)

    def _not_recomputed(self, model: Model, layout: Layout, tokens: float, tp_overlap: bool) -> float:
        """What an early-stopping recomputation of a layer skips (``timing.recomputed_gemms``): the GEMMs it does
        not run again and, after a dense layer's last GEMM, its TP reduction (pipelined with that GEMM under
        userbuffers: the GEMM alone)."""
        gemms = layer_gemms(model, layout)
        skipped = sum(count * gemm_seconds(self.gpu, m, n, k)
                      for m, n, k, count in gemms[len(recomputed_gemms(model, layout, True)):])
        t, act = layout.tp, tokens * model.hidden * 2
        if skipped and t > 1 and not (tp_overlap and layout.sequence_parallel):
            link = self.cluster.link(t)
            skipped += ring_allgather(act, t, link) if layout.sequence_parallel else ring_allreduce(act, t, link)
        return skipped

    def p2p(self, model: Model, layout: Layout, precision: str) -> float:
        """``[b, s, h]`` in bf16 scattered over the TP ranks (Narayanan et al. 2021, §4.1)."""
        if layout.pp == 1:
            return 0.0
        link = self.cluster.link(layout.world)
        send = layout.microbatch_size * model.seq_len / layout.cp * model.hidden * 2 / layout.tp
        return send / (link.bandwidth * LINK_EFFICIENCY) + link.latency

    def activations(self, model: Model, layout: Layout, precision: str,
                    elementwise: str = ELEMENTWISE[0]) -> ActivationModel:
        """A fused stack's (``elementwise`` "fused"): Korthikanti et al. 2022's count (§4; 16-bit whatever
        ``precision``): a layer's bytes, the first stage's embedding dropout mask sbh (with ``Model.dropout``), the
        last's output layer and loss 4sbh/t·(1 + V/h); full recomputation holds the recomputed layer's (selective)
        set once. Fused flash attention keeps no s×s scores: a layer keeps what selective recomputation keeps.
        plait's runtime ("plait-eager"): what its eager layers save, tensor by tensor (``eager_activations``, the
        count a calibrated host uses: each norm's float32 input, RoPE's and SwiGLU's operands, SDPA's output and
        log-sum-exp, the float32 loss)."""
        if elementwise == "plait-eager":
            return eager_activations(model, layout, precision)
        working = zero3_working(model, layout, precision)
        kept = layout if layout.recompute == "full" or not self.cluster.flash_attention else \
            replace(layout, recompute="selective")
        if layout.recompute == "full":
            working += activation_bytes_per_layer(model, replace(layout, recompute="selective"))
        last = 4 * model.seq_len / layout.cp * layout.microbatch_size * model.hidden / layout.tp * (
            1 + model.vocab / model.hidden)
        first = model.seq_len / layout.cp * layout.microbatch_size * model.hidden / (
            layout.tp if layout.sequence_parallel else 1) if model.dropout else 0.0
        return ActivationModel(activation_bytes_per_layer(model, kept), first, last, working)

    def hidden_reduction(self, backward: float) -> float:
        """All of it: the reduction runs on the network engines while the SMs compute."""
        return backward

    def optimizer_time(self, params: float, tensors: int, shards: float, optimizer: str = RUNTIME_OPTIMIZER) -> float:
        """The step streams its state and gradients through HBM: the bytes ``optimizer``'s implementation moves
        per element it updates and per element the rank holds (``plan.optimizers.OPTIMIZERS``)."""
        traffic = OPTIMIZERS[optimizer]
        return (traffic.owned / shards + traffic.replica) * params / self.gpu.memory_bandwidth

    def stream_time(self, nbytes: float, kernels: float) -> float:
        return nbytes / self.gpu.memory_bandwidth

    def accumulation_time(self, nbytes: float, grad_accumulation: str = RUNTIME_ACCUMULATION) -> float:
        """The accumulation's element-wise kernels stream their bytes at the GPU's memory bandwidth; plait's own
        (each bf16 gradient added into its float32 bucket: contiguous, of no measured kind) at the contiguous share
        of it where plait's kernels were measured on this GPU (``GPU.elementwise_rates``)."""
        rates = self.gpu.elementwise_rates
        if grad_accumulation == RUNTIME_ACCUMULATION and rates is not None:
            return nbytes / rates.rate("", False, self.gpu.memory_bandwidth)
        return nbytes / self.gpu.memory_bandwidth

    def step_syncs(self, model: Model, layout: Layout) -> tuple[float, float]:
        """Negligible on GPUs: not counted."""
        return 0.0, 0.0

    def forward_backward(self, model: Model, layout: Layout, precision: str, chunks: list[StageCosts], m: int,
                         rounds: str | None, makespan: float) -> Span:
        """The simulated schedule as it is: every GPU computes on its own."""
        return Span(makespan)

