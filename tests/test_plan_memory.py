"""Memory model against worked examples derived by hand (Korthikanti et al. 2022; mixed-precision Adam)."""

from dataclasses import replace

import pytest

from plait.plan import Cluster, Layout, Model, Training, estimate
from plait.plan import memory as mem
from plait.plan.config import GRAD_DTYPES
from plait.plan.memory import activation_bytes_per_layer, stage_layers, state_bytes

# A GPT-shaped model (MHA, 4h GELU MLP, dropout) so the paper's formulas apply verbatim: s=2048, h=1024, a=16.
GPT = Model(8, 1024, 16, 50304, 2048, bias=True, layernorm=True, dropout=True)
S, B, H, A = 2048, 1, 1024, 16
SBH = S * B * H  # 2,097,152
SCORE = 5 * A * S / H  # 5as/h = 160


def test_activations_no_parallelism():
    # sbh(34 + 5as/h) = 2,097,152 × 194 = 406,847,488 bytes
    assert activation_bytes_per_layer(GPT, Layout()) == SBH * (34 + SCORE) == 406_847_488


def test_activations_tensor_parallel():
    # t = 4: sbh(10 + 24/t + 5as/(ht)) = 2,097,152 × (10 + 6 + 40) = 117,440,512
    assert activation_bytes_per_layer(GPT, Layout(tp=4)) == SBH * (10 + 24 / 4 + SCORE / 4) == 117_440_512


def test_activations_tensor_and_sequence_parallel():
    # sbh(34/t + 5as/(ht)) = 2,097,152 × (8.5 + 40) = 101,711,872
    lay = Layout(tp=4, sequence_parallel=True)
    assert activation_bytes_per_layer(GPT, lay) == SBH * (34 / 4 + SCORE / 4) == 101_711_872


def test_selective_drops_score_term_and_full_keeps_input():
    sel = Layout(tp=4, sequence_parallel=True, recompute="selective")
    assert activation_bytes_per_layer(GPT, sel) == SBH * 34 / 4 == 17_825_792
    assert activation_bytes_per_layer(GPT, Layout(recompute="full")) == 2 * SBH
    assert activation_bytes_per_layer(GPT, Layout(tp=4, sequence_parallel=True, recompute="full")) == 2 * SBH / 4


def test_activations_gqa_glu_generalisation():
    # Llama 3 8B (no dropout), t=1, selective: replicated 8 + attention 4 + 4g (g = 8/32) + MLP 2·(f/h)·3 (GLU)
    m = Model.preset("llama3-8b")
    per_sbh = 8 + 4 + 4 * 0.25 + 2 * (14336 / 4096) * 3  # = 34
    assert activation_bytes_per_layer(m, Layout(recompute="selective")) == 8192 * 4096 * per_sbh


def test_states_mixed_precision_adam_and_zero():
    # Llama 3 8B, tp=2, pp=1, dp=4: each GPU holds half of every matrix and every norm whole (norms are
    # replicated over TP): (N - norms)/2 + norms = 4,015,263,744 parameters.
    m = Model.preset("llama3-8b")
    norms = (2 * 32 + 1) * 4096
    n = (m.n_params() - norms) / 2 + norms
    assert n == 4_015_263_744
    w, g, o = state_bytes(m, Layout(tp=2, dp=4, zero=0), 32, True, True)
    assert (w, g, o) == (2 * n, 4 * n, 12 * n)  # 18 bytes/parameter
    w, g, o = state_bytes(m, Layout(tp=2, dp=4, zero=1), 32, True, True)
    assert (w, g, o) == (2 * n, 4 * n, 12 * n / 4)
    w, g, o = state_bytes(m, Layout(tp=2, dp=4, zero=2), 32, True, True)
    assert (w, g, o) == (2 * n, 4 * n / 4, 12 * n / 4)
    w, g, o = state_bytes(m, Layout(tp=2, dp=4, zero=3), 32, True, True)
    assert (w, g, o) == (4 * n / 4, 4 * n / 4, 8 * n / 4)  # the float32 shard is the master: 16 bytes / 4


def test_stage_partition_balances_the_head():
    # Llama 3 8B: the head (2hV) costs ~2.4 layers, so the last of 4 ranks gets fewer layers.
    layers = stage_layers(Model.preset("llama3-8b"), 4)
    assert sum(layers) == 32 and layers[-1] < layers[1]
    assert stage_layers(Model.preset("llama3-405b"), 16)[0] < 8  # 126 layers: first rank lightened
    assert stage_layers(GPT, 1) == (8,)


def test_estimate_memory_uses_simulated_in_flight():
    # 1F1B with pp=4, M=8: the simulator says rank 0 holds 4 micro-batches, rank 3 one. Both end ranks
    # carry a 51.5M-parameter vocabulary matrix (embedding / untied head) at 18 B each; the last also
    # holds the logits and loss of one micro-batch, 4sbh(1 + V/h) = 419 MB (Korthikanti §4.3), which
    # makes it the most loaded GPU here although rank 0 holds 4× the layer activations.
    lay = Layout(tp=1, pp=4, dp=1, recompute="selective")
    e = estimate(GPT, Cluster("a100-80gb", 4), lay, Training(global_batch=8))
    assert e.peak_in_flight == 4
    layers = stage_layers(GPT, 4)
    per_layer = SBH * 34  # selective, no TP: 71.3 MB
    rank0_act = 4 * layers[0] * per_layer + 4 * SBH  # + embedding dropout mask per micro-batch in flight
    rank3_act = 1 * layers[3] * per_layer + 4 * SBH * (1 + GPT.vocab / H)
    assert e.memory.rank == 3
    assert e.memory.activations == pytest.approx(rank3_act)
    layer_p = GPT.layer_params()
    rank0 = 18 * (layers[0] * layer_p + GPT.embedding_params()) + rank0_act
    assert e.memory.total == pytest.approx(18 * (layers[3] * layer_p + GPT.head_params()) + rank3_act)
    assert e.memory.total > rank0
    assert e.memory.total == pytest.approx(
        e.memory.weights + e.memory.grads + e.memory.optimizer + e.memory.activations)


def test_gpipe_holds_every_microbatch():
    lay = Layout(pp=4, schedule="gpipe", recompute="selective")
    e = estimate(GPT, Cluster("a100-80gb", 4), lay, Training(global_batch=12))
    assert e.peak_in_flight == 12


def test_zero2_keeps_the_full_gradient_buffer_at_the_peak():
    """ZeRO-2 as the runtime runs it (one reduce-scatter per step, at each chunk's last backward): with more
    than one micro-batch the whole fp32 gradient buffer sits beside the activation peak, as under ZeRO-1;
    what is left after the step (pm.memory_report()'s grads) is the shards. With one micro-batch the peak
    comes before any gradient: the shards. Its traffic is ZeRO-1's, once per step."""
    m, cluster = Model.preset("llama3-8b", seq_len=2048), Cluster("h100-sxm", 16)

    def layout(zero: int) -> Layout:
        return Layout(tp=2, pp=2, dp=4, zero=zero, sequence_parallel=True)

    for batch, full in ((32, True), (4, False)):  # M = 8, then M = 1
        one, two = (estimate(m, cluster, layout(z), Training(batch)) for z in (1, 2))
        for r1, r2 in zip(one.rank_memory, two.rank_memory, strict=True):
            assert r2.grads_held == pytest.approx(r1.grads / 4)
            assert r2.grads == pytest.approx(r1.grads if full else r1.grads / 4)
            assert r2.total == pytest.approx(r1.total - (0 if full else r1.grads * 3 / 4))
        assert two.time["dp_comm"] == pytest.approx(one.time["dp_comm"]) and two.time["zero_comm"] == 0.0


def test_zero3_working_set_per_pipeline_stage():
    """ZeRO-3 under a pipeline (plait.data_parallel.param_shards): a chunk keeps its last block after a forward only
    when its backward runs next, so under any schedule a rank holds the largest pair of neighbouring blocks of one
    of its chunks: the embedding and a layer on the first stage, two layers on a middle one, the final norm and
    the head (or two layers) on the last. With two chunks a rank (interleaved-1f1b, looped-bfs) the larger of its
    chunks' pairs, whichever the schedule and the micro-batches. The estimate's memory rows and each rank's
    working set follow the rank."""
    from plait.cli.predict import memory_rows
    from plait.plan.memory import rank_params, zero3_working
    from plait.plan.stages import layout_stages

    m, cluster = Model.preset("llama3-8b", seq_len=2048), Cluster("h100-sxm", 16)
    lay = Layout(tp=2, pp=4, dp=2, zero=3)
    layer = sum(rank_params(m, lay, 1, False, False))
    embedding = sum(rank_params(m, lay, 0, True, False))
    head = sum(rank_params(m, lay, 0, False, True))  # the final norm and the head
    assert embedding > layer and head > layer
    per_rank = [zero3_working(m, lay, "bf16", r) for r in range(4)]
    assert per_rank == [2 * (embedding + layer), 2 * 2 * layer, 2 * 2 * layer, 2 * max(2 * layer, head)]
    assert zero3_working(m, lay, "bf16") == max(per_rank) and zero3_working(m, replace(lay, zero=2)) == 0.0
    assert [zero3_working(m, replace(lay, schedule="gpipe"), "bf16", r) for r in range(4)] == per_rank
    assert zero3_working(m, replace(lay, pp=1, dp=8), "bf16") == 2 * max(embedding + layer, 2 * layer, head)
    for schedule in ("interleaved-1f1b", "looped-bfs"):  # pp2 v2: chunks 0 and 2 on rank 0, 1 and 3 on rank 1
        two = Layout(tp=2, pp=2, dp=4, zero=3, schedule=schedule, virtual_stages=2)
        assert min(layout_stages(m, two).chunk_layers) >= 2
        assert [zero3_working(m, two, "bf16", r) for r in (0, 1)] == [2 * (embedding + layer),
                                                                      2 * max(2 * layer, head)]
    for planned in (lay, two):
        e = estimate(m, cluster, planned, Training(64))
        per_rank = [zero3_working(m, planned, "bf16", r) for r in range(planned.pp)]
        assert [row["params_gathered_peak"] for row in memory_rows(e)] == per_rank
        assert [r.working for r in e.rank_memory] == pytest.approx([e.rank_memory[0].working - per_rank[0] + w
                                                                     for w in per_rank])


def test_zero3_reduces_every_micro_batch_and_holds_shards_at_the_peak():
    """ZeRO-3 as the runtime runs it (plait.data_parallel.zero3_reducer): every backward reduce-scatters its blocks
    and accumulates sharded, so the shards are what is held at the activation peak for any M (ZeRO-2 holds the
    whole buffer when M > 1), and M - 1 reduce-scatters per step come on top of the end-of-step one."""
    from plait.plan.memory import max_rank_params
    from plait.plan.step_end import zero_per_microbatch

    m, cluster = Model.preset("llama3-8b", seq_len=2048), Cluster("h100-sxm", 16)
    layout = Layout(tp=2, pp=1, dp=8, zero=3)
    for batch, micro in ((8, 1), (64, 8)):
        e = estimate(m, cluster, layout, Training(batch))
        assert e.microbatches == micro
        for r in e.rank_memory:
            assert r.grads == pytest.approx(r.grads_held)
    params = max_rank_params(m, layout)
    reduce_scatter = cluster.costs.collective("reduce_scatter", 4 * params, 8, 16)
    extra = zero_per_microbatch(cluster, layout, params, 8) - zero_per_microbatch(cluster, layout, params, 1)
    assert reduce_scatter > 0 and extra == pytest.approx(reduce_scatter * 7 / 8)


def test_host_census_counts_what_context_parallel_attention_saves():
    """plait.context_parallel's core saves q, K and V as it attends with them (all-gathered: the whole sequence's),
    its output and log-sum-exp in float32 whatever the precision, and the output projection keeps its own copy of
    the output; it replaces selective recomputation's checkpointed core. Worked by hand against the same rank's
    tokens without CP (S = 32): T = 32 tokens a rank (S = 64, cp 2), 4 query heads and 1 KV head of 8, so
    Q = 1024, K = 256, the log-sum-exp 128 elements. Without CP the layer keeps q, K and V (SDPA shares the KV
    head among the query heads), SDPA's output (Q, also the projection's input) and log-sum-exp: 2 Q + 2 K + lse;
    the ring keeps q, K and V, its output and the projection's copy: 3 Q + 2 K + lse, Q = 1024 elements more.
    The all-gather keeps the other rank's K and V too (2 K more)."""
    from plait.plan.host.costs import eager_activations

    cfg = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=1)
    model, alone = Model.from_llama_config(cfg, 64), Model.from_llama_config(cfg, 32)

    def layer(m: Model, precision: str = "fp32", **kw) -> float:
        return eager_activations(m, Layout(**kw), precision).layer

    q, k = 1024, 256
    assert layer(model, cp=2, cp_comm="ring") == layer(alone) + 4 * q
    assert layer(model, cp=2, cp_comm="allgather") == layer(model, cp=2, cp_comm="ring") + 4 * 2 * k
    assert layer(model, cp=2, cp_comm="ring", recompute="selective") == layer(model, cp=2, cp_comm="ring")
    # bf16: the core's output is float32 (its log-sum-exp is, as SDPA's is)
    assert layer(model, "bf16", cp=2, cp_comm="ring") == layer(alone, "bf16") + 2 * q + 2 * q


def test_host_census_keeps_the_embeddings_ids_under_full_recomputation():
    """The embedding is not checkpointed: its int64 ids (8 bytes a token) are saved whatever the recomputation
    (bench/context.py's cp1-full measured 24 KB more than a count of 2 bytes a token, at 4,096 tokens)."""
    from plait.plan.host.costs import eager_activations

    model = Model.preset("tiny", seq_len=4096)
    full, none = (eager_activations(model, Layout(recompute=r), "fp32") for r in ("full", "none"))
    assert full.first == none.first == 8 * 4096


def test_host_census_keeps_float32_tensors_at_4_bytes_under_bf16():
    """In bf16 every saved tensor halves but those plait computes in float32: each RMSNorm's copy of its input
    (N) and its rsqrt values (T), SDPA's log-sum-exp (T·heads), the loss's softmax (T·V) and its integer
    targets and masks (10 bytes a token). Worked by hand: T = 64 tokens, h = 32 (N = 2048), 4 heads, V = 61."""
    from plait.plan.host.costs import eager_activations

    model = Model.from_llama_config(dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2), 64)
    fp32, bf16 = (eager_activations(model, Layout(), p) for p in ("fp32", "bf16"))
    n, t = 2048, 64
    assert bf16.layer == fp32.layer / 2 + 2 * (2 * (n + t) + t * 4)
    assert bf16.last == fp32.last / 2 + 2 * ((n + t) + t * 61) + 5 * t


def test_grad_dtype_sets_the_gradient_bytes_held_below_zero3():
    """A stack that keeps a 16-bit gradient buffer (Training.grad_dtype) holds 2 B of gradient a parameter, ZeRO's
    own count (Rajbhandari et al. 2020, Figure 1: (2 + 2 + K)Ψ). Worked by hand for Llama 3 8B at tp2 dp4
    (n = 4,015,263,744 parameters a GPU, ``test_states_mixed_precision_adam_and_zero``); ZeRO-3 keeps 16 B an owned
    element whatever the gradient dtype (2 + 2 + 12 with 16-bit shards, 4 + 4 + 8 with a float32 master shard)."""
    m, n = Model.preset("llama3-8b"), 4_015_263_744
    assert state_bytes(m, Layout(tp=2, dp=4, zero=0), 32, True, True, "bf16", "bf16") == (2 * n, 2 * n, 12 * n)
    assert state_bytes(m, Layout(tp=2, dp=4, zero=1), 32, True, True, "bf16", "fp16") == (2 * n, 2 * n, 3 * n)
    assert state_bytes(m, Layout(tp=2, dp=4, zero=2), 32, True, True, "bf16", "bf16") == (2 * n, n / 2, 3 * n)
    assert state_bytes(m, Layout(tp=2, dp=4, zero=3), 32, True, True, "bf16", "bf16") == (n, n, 2 * n)
    # the estimate holds them: 2n fewer bytes on the GPU (ZeRO-1: the whole 16-bit buffer at the peak)
    lay, cluster = Layout(tp=2, dp=4, zero=1), Cluster("h100-sxm", 8)
    fp32, bf16 = (estimate(m, cluster, lay, Training(8, grad_dtype=g)) for g in ("fp32", "bf16"))
    assert fp32.memory.grads - bf16.memory.grads == pytest.approx(2 * n)
    assert fp32.memory.total - bf16.memory.total == pytest.approx(2 * n)


def test_grad_dtype_halves_the_bytes_every_gradient_collective_moves():
    """The DP all-reduce (no ZeRO), ZeRO-1's reduce-scatter and ZeRO-3's per-block reduce-scatters move 2 B a
    parameter in a 16-bit stack. Worked by hand on one DGX A100 node (dp 8 over NVLink 3, 300 GB/s a direction
    at the catalogue's link efficiency, 3 µs a step), P = 1e9 parameters a GPU: a ring all-reduce moves
    2·7/8·2P bytes in 14 steps, a reduce-scatter 7/8·2P in 7; ZeRO-3 in one block of each."""
    from plait.plan.catalogue import NVLINK3
    from plait.plan.gpu import LINK_EFFICIENCY
    from plait.plan.step_end import dp_sync_parts, zero3_collectives

    m, cluster, p = Model.preset("llama3-8b"), Cluster("a100-80gb", 8), 1e9
    bw, lat = NVLINK3.bandwidth * LINK_EFFICIENCY, NVLINK3.latency
    all_reduce = dp_sync_parts(m, cluster, Layout(dp=8), p, "bf16")[0]
    assert all_reduce == pytest.approx(2 * 7 / 8 * 2e9 / bw + 14 * lat)
    reduce_scatter = dp_sync_parts(m, cluster, Layout(dp=8, zero=1), p, "bf16")[0]
    assert reduce_scatter == pytest.approx(7 / 8 * 2e9 / bw + 7 * lat)
    assert zero3_collectives(cluster, Layout(dp=8, zero=3), p, 1, "bf16")[1] == pytest.approx(reduce_scatter)
    assert dp_sync_parts(m, cluster, Layout(dp=8), p)[0] == pytest.approx(2 * 7 / 8 * 4e9 / bw + 14 * lat)


def test_grad_dtype_is_validated_and_plait_plans_keep_fp32():
    """Training.grad_dtype names its choices, needs bf16 precision for a 16-bit value, and a plan with a 16-bit
    gradient is not turned into a configuration plait's runtime would run (it keeps fp32 gradients)."""
    from plait.errors import ConfigError

    assert Training(8).grad_dtype == "fp32" and GRAD_DTYPES[Training(8, grad_dtype="fp16").grad_dtype] == 2
    with pytest.raises(ConfigError, match="grad_dtype='int8': not one of fp32, bf16, fp16"):
        Training(8, grad_dtype="int8")
    with pytest.raises(ConfigError, match="grad_dtype: 'bf16' needs precision='bf16'"):
        Training(8, precision="fp32", grad_dtype="bf16")
    with pytest.raises(ConfigError, match="grad_dtype: 'bf16' is planned but plait's runtime keeps and reduces fp32"):
        Layout(dp=8).to_parallel_config(Training(8, grad_dtype="bf16"))
    assert Layout(dp=8).to_parallel_config(Training(8, masters="plait")).dp == 8


def test_a_model_without_dropout_keeps_no_masks():
    """Without dropout (Model.dropout False: plait's Llama, MPT's yamls, NeMo's Llama and Nemotron configs) a layer
    keeps no dropout masks (Korthikanti et al.'s 2sbh of the replicated 10) and its unfused attention only the
    softmax output (2as/h of the 5as/h); the first stage keeps no embedding mask. Worked by hand for GPT's shape:
    sbh(8 + 24/t + 2as/(ht)) at t = 4 is 2,097,152 × (8 + 6 + 16) = 62,914,560 bytes."""
    from dataclasses import replace

    plain = replace(GPT, dropout=False)
    assert activation_bytes_per_layer(plain, Layout(tp=4)) == SBH * (8 + 24 / 4 + 2 * A * S / H / 4) == 62_914_560
    assert activation_bytes_per_layer(plain, Layout(tp=4, recompute="selective")) == SBH * (8 + 6)
    assert activation_bytes_per_layer(GPT, Layout(tp=4, recompute="selective")) == SBH * (10 + 6)
    cluster = Cluster("a100-80gb", 4, flash_attention=False)
    assert cluster.costs.activations(plain, Layout(tp=4), "bf16").first == 0.0
    assert cluster.costs.activations(GPT, Layout(tp=4), "bf16").first == SBH


# A small Llama-shaped model: s=16, h=64, 4 heads of 16, 2 KV heads, SwiGLU f=128, vocabulary 100.
TINY = Model(2, 64, 4, 100, 16, 128, 2, glu=True)


def test_torchtitan_op_policy_keeps_every_other_matmul_and_the_attention():
    # micro-batch 2: 32 tokens. Kept per token: the block's input 64 + wq 64 + wv 32 + w1 128 + w2 64 + the
    # attention's output 64 = 416 elements × 2 B = 832 B, + the float32 log-sum-exp 4 heads × 4 B = 16 B -> 848 B;
    # × 32 tokens = 27,136 B (Korthikanti's selective set here: sbh(8 + 4 + 4·0.5 + 2·2·3) = 32·64·26 = 53,248 B)
    lay = Layout(dp=8, microbatch_size=2, recompute="selective", zero=3)
    cluster = Cluster("h100-sxm", 8)
    titan = Training(16, selective_policy="torchtitan-op")
    assert mem.activations(cluster, TINY, lay, titan).layer == 27_136
    assert mem.activations(cluster, TINY, lay, Training(16)).layer == 53_248
    # the policy applies to selective recomputation only
    none = replace(lay, recompute="none")
    assert mem.activations(cluster, TINY, none, titan).layer == mem.activations(cluster, TINY, none, Training(16)).layer


def test_torch_cross_entropy_holds_twelve_bytes_a_logit():
    # 32 tokens × 100 logits: Korthikanti's head 4sbh + 4sbv = 8,192 + 12,800; torch's cross_entropy on a float32
    # copy holds 12 B a logit at the log-softmax's backward: 8,192 + 38,400 = 46,592 B
    lay = Layout(dp=8, microbatch_size=2, zero=3)
    cluster = Cluster("h100-sxm", 8)
    assert mem.activations(cluster, TINY, lay, Training(16)).last == 20_992
    assert mem.activations(cluster, TINY, lay, Training(16, loss="torch-cross-entropy")).last == 46_592
    e0 = estimate(TINY, cluster, lay, Training(16))
    e1 = estimate(TINY, cluster, lay, Training(16, loss="torch-cross-entropy"))
    assert e1.memory.total - e0.memory.total == pytest.approx(25_600)


def test_torchtitan_op_policy_is_refused_with_tensor_parallelism():
    from plait.errors import ConfigError
    from plait.plan.config import check

    lay = Layout(tp=2, dp=4, recompute="selective")
    bad = check(TINY, Cluster("h100-sxm", 8), lay, Training(16, selective_policy="torchtitan-op"))
    assert bad is not None and bad[0] == "policy" and "tp = 2" in bad[1]
    with pytest.raises(ConfigError, match="selective_policy"):
        Training(16, selective_policy="every-op")
    with pytest.raises(ConfigError, match="loss"):
        Layout(dp=8).to_parallel_config(Training(16, loss="torch-cross-entropy"))


def test_megatron_vocab_parallel_cross_entropy_holds_six_bytes_a_logit():
    # Megatron-Core's loss: the bf16 logits beside their float32 copy (2 + 4 B); 32 tokens × 100 logits × 6 B =
    # 19,200 B beside the head's 4sbh = 8,192 B
    lay = Layout(dp=8, microbatch_size=2)
    acts = mem.activations(Cluster("h100-sxm", 8), TINY, lay, Training(16, loss="megatron-vocab-parallel"))
    assert acts.last == 8_192 + 19_200


def test_torchtitan_fsdp2_holds_the_root_and_last_block_and_no_gradient_at_the_peak():
    # FSDP2 as torchtitan wraps it: the root group (embedding 100·64, output 100·64, final norm 64 = 12,864) and the
    # last block (wq 64·64 + wk, wv 2·64·32 + wo 64·64 + SwiGLU 3·64·128 + 2 norms of 64 = 36,992) gathered in bf16
    # at the loss's backward: 2 × 49,856 = 99,712 B (plait's ZeRO-3: its two largest neighbouring blocks, 2 layers,
    # 2 × 73,984 = 147,968 B)
    lay = Layout(dp=8, microbatch_size=2, zero=3)
    cluster = Cluster("h100-sxm", 8)
    titan = Training(16, zero3_impl="torchtitan-fsdp2")
    assert mem.fsdp2_working(TINY, lay) == 99_712
    assert mem.activations(cluster, TINY, lay, titan).working == 99_712
    assert mem.activations(cluster, TINY, lay, Training(16)).working == 147_968
    # one micro-batch: zero_grad before the forward, the shards made at each block's post-backward: none at the peak
    one, plait = estimate(TINY, cluster, lay, titan).memory, estimate(TINY, cluster, lay, Training(16)).memory
    shards = 4 * TINY.n_params() / 8
    assert one.grads == 0 and one.grads_held == pytest.approx(shards) and plait.grads == pytest.approx(shards)
    assert one.total == pytest.approx(plait.total - shards - 147_968 + 99_712)
    # two micro-batches: the first backward's shards are there at the second's peak
    two = estimate(TINY, cluster, lay, replace(titan, global_batch=32)).memory
    assert two.grads == pytest.approx(shards)
    # it describes another stack: plait will not run it
    from plait.errors import ConfigError
    with pytest.raises(ConfigError, match="zero3_impl"):
        lay.to_parallel_config(titan)
