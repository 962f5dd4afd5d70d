"""Single-process checks of the runtime on the device ``--device`` names (cpu by default; ``bench/gpu_check.py``
runs this module with ``--device cuda``): a world of one process on that device's backend (Gloo on CPU, NCCL on
CUDA), a parallelised model against the plain one, bf16, generation, memory figures and the host reads per step."""

from __future__ import annotations

import collections
import datetime
import importlib.util
import math
import os

import pytest
import torch
import torch.distributed as dist

import plait
from plait.devices import HostSyncCounter
from plait.models import Llama, LlamaConfig

CFG = dict(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


@pytest.fixture(scope="module")
def ctx(device):
    """A one-process world whose backend matches ``device``; destroyed after the module."""
    from plait.distributed.launch import free_port

    if dist.is_initialized():
        pytest.fail("a process group is already initialised in the test process")
    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    saved = {key: os.environ.get(key) for key in keys}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK=str(device.index or 0))
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    try:
        with plait.init(1, 1, 1) as context:
            assert context.device.type == device.type, (context.device, device)
            yield context
    finally:
        dist.destroy_process_group()
        for key, value in saved.items():  # processes the later tests start must not inherit this world's port
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _batch(b: int = 4, s: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG["vocab_size"], (b, s + 1), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_parallel_step_equals_the_plain_model_on_the_device(ctx, device):
    torch.manual_seed(0)
    plain = Llama(LlamaConfig(**CFG)).to(device)
    torch.manual_seed(0)
    pm = plait.parallelize(Llama(LlamaConfig(**CFG)), ctx, microbatches=2)
    tokens = _batch().to(device)
    ref = plain.loss(tokens[:, :-1], tokens[:, 1:])
    ref.backward()
    loss = pm.train_step(tokens[:, :-1], tokens[:, 1:])
    assert abs(loss - ref.item()) <= 1e-5 * abs(ref.item())
    ref_grads = {k: p.grad for k, p in plain.named_parameters()}
    grads = pm.full_state_dict(grads=True)
    assert set(grads) >= set(ref_grads)
    worst = max(_rel(grads[k], g) for k, g in ref_grads.items())
    assert worst <= 1e-4, worst
    assert all(p.device.type == device.type for p in pm.parameters())


def test_a_training_step_reads_the_device_twice(ctx, device):
    """Host reads per ``train_step`` (each one waits for the device): one for the batch's id range and target
    count, one for the loss. A new ``.item()`` or ``float(tensor)`` in the step's path fails this test."""
    torch.manual_seed(0)
    for microbatches in (1, 4):
        pm = plait.parallelize(Llama(LlamaConfig(**CFG)), ctx, microbatches=microbatches)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        tokens = _batch().to(device)
        pm.train_step(tokens[:, :-1], tokens[:, 1:])  # the first step measures memory (its own hooks)
        opt.step()
        with HostSyncCounter(device) as counter:
            pm.train_step(tokens[:, :-1], tokens[:, 1:])
        assert counter.total == 2, dict(counter.counts)


def test_a_training_step_makes_no_shape_from_its_values(ctx, device):
    """No operation of a step sizes its output by a tensor's values (``aten::nonzero``, which boolean-mask
    indexing calls): on a GPU it waits for every kernel queued before it, in the middle of the step. The
    vocabulary-parallel loss's backward subtracted its one-hot through ``grad[rows[hit], t[hit]]``."""
    torch.manual_seed(0)
    pm = plait.parallelize(Llama(LlamaConfig(**CFG)), ctx)
    tokens = _batch().to(device)
    targets = tokens[:, 1:].clone()
    targets[0, :5] = -100  # ignored targets: the rows the one-hot leaves out
    pm.train_step(tokens[:, :-1], targets)
    names = [name for name, _ in _top_ops(lambda: pm.train_step(tokens[:, :-1], targets), "aten::")]
    assert "aten::mm" in names and "aten::nonzero" not in names, collections.Counter(names)["aten::nonzero"]


def _top_ops(fn, prefix: str = "aten::") -> list[tuple[str, str]]:
    """(name, parent's name) of every profiler event ``fn()`` records whose name starts with ``prefix`` (aten ops
    by default), the parent "" for those called from Python."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [(e.name, e.cpu_parent.name if e.cpu_parent is not None else "") for e in prof.events()
            if e.name.startswith(prefix)]


def test_gradient_bookkeeping_runs_no_tensor_op_per_parameter(ctx, device):
    """A bf16 step's gradient bookkeeping around the model's own work runs no tensor op per parameter: the views
    of the gradient buckets are made once per buffer, a bucket nothing wrote to is not zeroed again, and a
    bucket's bf16 gradients are added into its float32 buffer by one node (one multi-tensor add per bucket and
    micro-batch), with no per-parameter cast back to float32 and no per-parameter accumulation node or hook."""
    from plait.optim import ParallelOptimizer

    torch.manual_seed(0)
    pm = plait.parallelize(Llama(LlamaConfig(**CFG)), ctx, microbatches=2, precision="bf16")
    opt = ParallelOptimizer(pm, lr=1e-3, precision="bf16", clip=1.0)
    tokens = _batch().to(device)

    def step() -> None:
        pm.zero_grad()
        pm.train_step(tokens[:, :-1], tokens[:, 1:])
        opt.step()

    step()
    step()
    top = [name for name, parent in _top_ops(pm.zero_grad) if not parent]
    assert top == ["aten::zero_"] * len(pm.grad_buckets()), top
    assert _top_ops(pm.zero_grad) == []  # nothing wrote to the zeroed buffers
    assert _top_ops(lambda: [r.point_grads() for r in pm.reducers.values()]) == []
    pm.train_step(tokens[:, :-1], tokens[:, 1:])
    assert _top_ops(lambda: [pc.grad() for pc in opt.layout.pieces]) == []
    nodes = collections.Counter(name for name, _ in _top_ops(step, "autograd::engine::evaluate_function: "))
    assert nodes["autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"] == 2, nodes  # the anchor's
    assert nodes["autograd::engine::evaluate_function: ToCopyBackward0"] < len(list(pm.parameters())), nodes
    ops = _top_ops(step)
    assert not [name for name, parent in ops if parent.endswith("AccumulateGrad")]
    # torch's multi-tensor AdamW on a GPU advances its step counts with _foreach_add_ of its own: not bookkeeping
    adds = collections.Counter(parent for name, parent in ops
                               if name == "aten::_foreach_add_" and not parent.startswith("Optimizer.step#"))
    assert adds == {"_CastGroupBackward": 2 * len(pm.grad_buckets())}, adds  # a bucket's, per micro-batch
    assert sum(name == "aten::zero_" and not parent for name, parent in ops) == len(pm.grad_buckets())


def test_bf16_copies_hand_the_gradients_over_after_the_whole_backward(ctx, device, monkeypatch):
    """When the buckets get their gradients (the planner's ``plan.accumulation`` ``after_backward``): with bf16
    copies of fp32 parameters in buckets no other rank reduces (this one-process world; a split backward's are
    the same) every bucket takes its gradients after the embedding's output got its gradient (the last of the
    backward), because the copies' node is made before the forward and autograd runs the newest ready nodes
    first; in fp32 the post-accumulate hooks of the last layers' parameters fire before it. Buckets reduced over
    other ranks take them as soon as they are complete (``tests/test_optim_unit.py``)."""
    from plait.data_parallel.reducer import GradReducer

    events: list[str] = []
    take, on_grad = GradReducer.take, GradReducer._on_grad
    monkeypatch.setattr(GradReducer, "take", lambda self, b, g: (events.append("bucket"), take(self, b, g))[1])
    monkeypatch.setattr(GradReducer, "_on_grad", lambda self, p: (events.append("bucket"), on_grad(self, p))[1])
    tokens = _batch().to(device)

    def mark(module, inputs, out) -> None:  # the embedding's output gets its gradient last in the backward
        out.register_hook(lambda g: events.append("embedding"))

    for precision in ("bf16", "fp32"):
        torch.manual_seed(0)
        pm = plait.parallelize(Llama(LlamaConfig(**CFG)), ctx, microbatches=1, precision=precision)
        embed = next(iter(pm.chunks.values())).blocks[0]  # the embedding (a chunk runs its blocks in order)
        embed.register_forward_hook(mark)
        events.clear()
        pm.train_step(tokens[:, :-1], tokens[:, 1:])
        first = events.index("embedding")
        if precision == "bf16":
            assert first < events.index("bucket"), events
        else:
            assert 0 < first, events


def test_bucket_cast_gradients_equal_autograd_accumulation_bit_for_bit(ctx, device):
    """The bf16 gradients a bucket's cast node adds into the float32 buffer give the same bits as autograd's
    per-parameter cast back to float32 and accumulation (a bf16 value converts exactly): 3 clipped AdamW steps of
    2 micro-batches, tied embeddings (one copy used twice) included."""
    from plait.optim import ParallelOptimizer

    if device.type != "cpu":
        pytest.skip("two runs on a GPU differ in their last bits anyway (attention's backward sums with atomics)")
    tokens = _batch().to(device)
    runs = []
    for routed in (True, False):
        torch.manual_seed(0)
        pm = plait.parallelize(Llama(LlamaConfig(**CFG, tie_embeddings=True)), ctx, microbatches=2, precision="bf16")
        assert len(pm.cast.groups) == len(pm.grad_buckets())
        if not routed:
            pm.cast.route([])  # every copy a plain p.to(bf16): autograd casts back and accumulates into .grad
        opt = ParallelOptimizer(pm, lr=1e-3, precision="bf16", clip=1.0)
        for _ in range(3):
            opt.zero_grad()
            loss = pm.train_step(tokens[:, :-1], tokens[:, 1:])
            opt.step()
        runs.append((loss, pm.full_state_dict(grads=True), pm.full_state_dict()))
    (loss, grads, params), (ref_loss, ref_grads, ref_params) = runs
    assert loss == ref_loss
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    assert all(torch.equal(params[k], ref_params[k]) for k in ref_params)


def test_a_bf16_step_walks_no_module_tree(ctx, device):
    """The parameters, their names for the per-step bf16 copies and the tied names are listed once when the model
    is built: a step (zero_grad, train_step, the optimizer's step) walks no module tree (each walk is hundreds of
    Python calls per step at a real model's size)."""
    import sys

    from plait.optim import ParallelOptimizer

    torch.manual_seed(0)
    pm = plait.parallelize(Llama(LlamaConfig(**CFG)), ctx, microbatches=2, precision="bf16")
    opt = ParallelOptimizer(pm, lr=1e-3, precision="bf16", clip=1.0)
    tokens = _batch().to(device)
    pm.train_step(tokens[:, :-1], tokens[:, 1:])  # the first step measures memory (its own hooks)
    walks = {torch.nn.Module.named_modules.__code__, torch.nn.Module._named_members.__code__}
    seen: list[str] = []

    def tracer(frame, event, arg) -> None:
        if event == "call" and frame.f_code in walks:
            seen.append(frame.f_back.f_code.co_qualname if frame.f_back else "?")

    sys.setprofile(tracer)
    try:
        opt.zero_grad()
        pm.train_step(tokens[:, :-1], tokens[:, 1:])
        opt.step()
    finally:
        sys.setprofile(None)
    assert seen == [], collections.Counter(seen)


def test_bf16_step_on_the_device_tracks_fp32(ctx, device):
    tokens = _batch().to(device)
    losses = {}
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        pm = plait.parallelize(Llama(LlamaConfig(**CFG)), ctx, microbatches=2, precision=precision)
        losses[precision] = pm.train_step(tokens[:, :-1], tokens[:, 1:])
        if precision == "bf16":
            assert all(p.dtype == torch.float32 for p in pm.parameters())  # fp32 masters, bf16 compute copies
    assert abs(losses["bf16"] - losses["fp32"]) <= 2e-2 * losses["fp32"], losses


def test_gradient_norm_on_the_device_is_the_float64_norm(ctx, device):
    """The clip's norm on this device (one fused kernel per dtype on a GPU, float64 chunks on a CPU) equals the
    float64 norm of the full gradients, bf16 weights over fp32 masters."""
    from plait.optim import ParallelOptimizer

    torch.manual_seed(0)
    pm = plait.parallelize(Llama(LlamaConfig(**CFG)), ctx, microbatches=2, precision="bf16")
    opt = ParallelOptimizer(pm, lr=1e-3, precision="bf16", clip=1.0)
    tokens = _batch().to(device)
    pm.train_step(tokens[:, :-1], tokens[:, 1:])
    grads = pm.full_state_dict(grads=True)
    want = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
    assert want > 0
    assert opt.grad_norm() == pytest.approx(want, rel=1e-12)


def test_greedy_generation_equals_argmax_of_full_forwards(ctx, device, monkeypatch):
    """plait.generate's greedy tokens are the full forwards' argmax; its decode steps read keys to a rounded
    length on a CUDA device (one attention shape for these steps, the extra keys masked), the exact one elsewhere."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = Llama(LlamaConfig(**CFG)).to(device).eval()
    prompt = _batch(1, 8, seed=1)[0, :8].tolist()
    lengths: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def recorded(q, k, v, *args, **kw):
        lengths.append(k.shape[2])
        return sdpa(q, k, v, *args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    out = plait.generate(model, prompt, max_new_tokens=6)
    monkeypatch.undo()
    decode = lengths[CFG["n_layers"]:]  # one call per layer a forward; the prompt's forward first
    assert set(decode) == ({16} if device.type == "cuda" else set(range(9, 14))), decode
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            logits = model(torch.tensor([ids], device=device))
            ids.append(int(logits[0, -1].argmax()))
    assert out == ids[len(prompt):]


def test_serving_runner_decodes_on_the_device(ctx, device):
    """plait serve's runner on the device: paged KV through a prompt and decode steps gives the greedy tokens of
    full forwards, no forward reads a device value on the host, and a row with penalties and a logit bias
    samples as its processors do on a host copy of the full forward's logits."""
    from plait.generation.decode import Sampling
    from plait.serve.runner import Row, Runner, Step
    from plait.serve.sampling import Params, SeqState

    torch.manual_seed(0)
    model = Llama(LlamaConfig(**CFG)).to(device).eval()
    runner = Runner(model, num_blocks=8, block_size=8)
    reads: list[int] = []
    run = runner.dec.run

    def counted(c, x, caches):
        with HostSyncCounter(device) as counter:
            out = run(c, x, caches)
        reads.append(counter.total)
        return out

    runner.dec.run = counted  # type: ignore[method-assign]
    plain = Params(Sampling(4, 0.0))
    shaped = Params(Sampling(4, 0.0), repetition_penalty=1.3, frequency_penalty=0.5, logit_bias={5: 2.0})
    ref = SeqState(shaped, CFG["vocab_size"], torch.device("cpu"))
    ids = [_batch(1, 8, seed=s)[0, :8].tolist() for s in (1, 2)]
    fed = [list(x) for x in ids]
    step = Step(new=[(0, plain), (1, shaped)], rows=[Row(i, x, 0, [2 * i, 2 * i + 1], True) for i, x in enumerate(ids)])
    for _ in range(3):
        out = runner.execute(step)
        with torch.no_grad():
            last = [model(torch.tensor([x], device=device))[0, -1] for x in ids]
        ref.see_prompt(fed[1])
        assert [o[0] for o in out] == [int(last[0].argmax()), ref.next_token(last[1].cpu())]
        fed = [[o[0]] for o in out]
        step = Step(rows=[Row(i, fed[i], len(ids[i]), [2 * i, 2 * i + 1], True) for i in range(2)])
        ids = [[*x, *f] for x, f in zip(ids, fed, strict=True)]
    assert reads == [0] * len(reads) and len(reads) == 3, reads  # the two prompts share one forward, then 2 decodes


def test_a_model_plait_serve_loads_in_one_process_is_on_the_device(device, tmp_path):
    """``plait serve`` / ``plait generate`` with one process (no process group): the model they load is on this
    process's device (the GPU where there is one), and its greedy tokens are the plain model's there."""
    from plait.generation.job import load_model

    torch.manual_seed(0)
    plain = Llama(LlamaConfig(**CFG)).eval()
    plain.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))[0]
    assert {(p.device.type, p.device.index or 0) for p in loaded.parameters()} == {(device.type, device.index or 0)}
    prompt = _batch(2, 8)[:, :8].tolist()
    assert plait.generate(loaded, prompt, max_new_tokens=4) == plait.generate(plain.to(device), prompt,
                                                                              max_new_tokens=4)


def test_memory_report_on_the_device(ctx, device):
    torch.manual_seed(0)
    pm = plait.parallelize(Llama(LlamaConfig(**CFG)), ctx)
    tokens = _batch().to(device)
    pm.train_step(tokens[:, :-1], tokens[:, 1:])
    report = pm.memory_report()
    n_params = sum(p.numel() for p in pm.parameters())
    assert report["params"] == 4 * n_params and report["activations_peak"] > 0
    if device.type == "cuda":  # the allocator saw at least the weights, their gradients and the saved tensors
        assert report["device_peak"] >= report["params"] + report["activations_peak"]
    else:
        assert "device_peak" not in report


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the [dev] extra")
def test_logits_equal_transformers_on_the_device(ctx, device, tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = Llama(LlamaConfig(**CFG)).eval()
    model.save_pretrained(tmp_path)
    hf = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").to(device).eval()
    model.to(device)
    tokens = _batch(2, 24)[:, :24].to(device)
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    # fp32 throughout; on a GPU the fused attention kernels sum in another order than the CPU's
    assert _rel(ours, theirs) <= (1e-5 if device.type == "cpu" else 1e-4)
