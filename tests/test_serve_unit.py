"""plait serve's parts in one process: stop strings, the scheduler, paged KV with preemption, logprobs, timeouts."""

from __future__ import annotations

import threading

import pytest
import torch

from plait.generation.decode import Sampling, generate_ids
from plait.generation.text import TextTracker
from plait.models import Llama, LlamaConfig
from plait.serve.engine import Engine, Request
from plait.serve.kv import BlockAllocator
from plait.serve.metrics import Metrics
from plait.serve.runner import Runner
from plait.serve.sampling import Params, logprobs
from plait.serve.scheduler import Scheduler, Seq
from plait.tokenizers import ByteTokenizer
from serve_util import run_waves

TOK = ByteTokenizer()


def _push_all(tracker: TextTracker, text: str) -> str:
    return "".join(tracker.push(b) for b in text.encode()) + tracker.flush()


def test_text_tracker_cuts_stops_across_tokens_and_keeps_utf8_whole():
    t = TextTracker(TOK, ["END", "zz"])
    deltas = [t.push(b) for b in "café END more".encode()]
    assert "".join(deltas) == "café " and t.stopped == "END" and t.flush() == ""
    assert "\ufffd" not in "".join(deltas)  # é is two bytes: held back until whole
    t = TextTracker(TOK, ["END"], include_stop=True)
    assert _push_all(t, "a ENDb") == "a END"
    t = TextTracker(TOK, ["xyz"])
    assert _push_all(t, "abcxy") == "abcxy" and t.stopped is None  # a held-back prefix released at the end
    t = TextTracker(TOK, ["b"])
    assert t.push(ord("b"), check=False) == "b" and t.stopped is None  # min_tokens: stops not yet looked for


def _seq(rid: int, prompt: int, max_tokens: int = 8) -> Seq:
    return Seq(rid, list(range(prompt)), Params(Sampling(max_tokens)))


def test_scheduler_budget_decodes_first_and_preempts_the_latest():
    sched = Scheduler(BlockAllocator(6, 4), max_batch=4, step_tokens=10)
    a, b = _seq(1, 9), _seq(2, 9)
    sched.add(a)
    sched.add(b)
    assert [(s.rid, n) for s, n in sched.schedule()] == [(1, 9), (2, 1)]  # b's first chunk: what the budget leaves
    a.computed, b.computed = 9, 1
    a.out.append(0)
    assert [(s.rid, n) for s, n in sched.schedule()] == [(1, 1), (2, 8)]  # a decodes first
    a.computed, b.computed = 10, 9
    b.out.append(0)
    for _ in range(3):  # a and b grow until 6 blocks of 4 no longer hold both
        a.out.append(0)
        b.out.append(0)
        pairs = sched.schedule()
        for s, n in pairs:
            s.computed += n
    assert sched.preemptions == 1 and sched.waiting[0] is b and b.computed == 0 and not b.table
    sched = Scheduler(BlockAllocator(6, 4), max_batch=4, step_tokens=12)
    sched.add(_seq(1, 9))
    sched.add(_seq(2, 16))  # its first chunk (3 tokens) would fit the 3 free blocks, its prompt (4 blocks) not
    assert [(s.rid, n) for s, n in sched.schedule()] == [(1, 9)] and sched.alloc.used == 3
    reserve = Scheduler(BlockAllocator(6, 4), max_batch=4, reserve=True)
    reserve.add(_seq(1, 9, 8))
    reserve.add(_seq(2, 9, 8))
    assert [s.rid for s, _ in reserve.schedule()] == [1] and reserve.alloc.used == 5  # 17 positions up front


def _tiny_model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96)).eval()


def _assert_equals_generate(model: Llama, jobs: list[tuple], outs: list[list[dict]]) -> None:
    for (prompt, n, temperature, seed), events in zip(jobs, outs, strict=True):
        assert [e["id"] for e in events if e["type"] == "token"] == generate_ids(
            model, [prompt], Sampling(n, temperature, 0, seed))[0]


def test_engine_with_a_small_pool_and_budget_equals_generate():
    model = _tiny_model()
    runner = Runner(model, num_blocks=40, block_size=4)
    sched = Scheduler(BlockAllocator(40, 4), max_batch=8, step_tokens=8)
    engine = Engine(runner, sched, TOK, Metrics(), distributed=False)
    jobs = [(list(range(3 + i, 10 + 5 * i)), 30 + 3 * i, 0.0 if i % 2 else 0.9, i) for i in range(6)]
    _assert_equals_generate(model, jobs, run_waves(engine, [jobs]))
    assert sched.preemptions > 0 and engine.metrics.prefill_chunks > len(jobs) and sched.alloc.used == 0


def test_requests_ended_by_a_stop_are_counted_in_metrics():
    engine = Engine(Runner(_tiny_model(), num_blocks=40, block_size=4), Scheduler(BlockAllocator(40, 4), max_batch=4),
                    TOK, Metrics(), distributed=False)
    events: list[dict] = []

    def sink(ev):
        events.append(ev)
        engine.request_stop("SIGTERM", 0.0)  # at its first token, as a signal handler would: no grace
    engine.submit(Request([1, 2, 3], Params(Sampling(80, 0.0, 0, 0)), sink))
    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    thread.join(60)
    engine.stopping.set()
    thread.join(10)
    assert events[-1]["type"] == "error" and events[-1]["code"] == "shutting_down", events[-1]
    assert engine.metrics.requests == {"shutdown": 1}
    assert 'plait_requests_total{status="shutdown"} 1' in engine.metrics.render()


def test_prefix_cache_shares_blocks_evicts_oldest_and_counts_holders():
    alloc = BlockAllocator(4, 2, prefix_cache=True)
    a, keys = [], alloc.chain([1, 2, 3, 4, 5], 2, [])
    assert len(keys) == 2 and alloc.chain([1, 2, 3, 9], 2, [])[0] == keys[0] != alloc.chain([1, 2, 3, 9], 2, [])[1]
    assert alloc.chain([7, 7, 3, 4], 2, [])[1] != keys[1]  # a key names the whole prefix, not its block alone
    assert alloc.grow(a, 5) and a == [0, 1, 2] and alloc.match(keys) == []
    alloc.publish(a, keys)  # blocks 0 and 1 hold tokens 1..4
    b: list[int] = []
    assert alloc.match(keys) == [0, 1] and alloc.match(alloc.chain([1, 2, 7, 7], 2, [])) == [0]
    alloc.share(b, alloc.match(keys))
    assert alloc.refs == {0: 2, 1: 2, 2: 1} and alloc.used == 3
    alloc.release(a)
    assert alloc.used == 2 and alloc.free == [3, 2] and not alloc.evictable  # b still holds 0 and 1
    alloc.release(b)
    assert alloc.used == 0 and list(alloc.evictable) == [1, 0] and alloc.available == 4
    c: list[int] = []
    assert alloc.grow(c, 8) and c == [2, 3, 1, 0]  # the free blocks first, then the cached ones, oldest first
    assert alloc.match(keys) == [] and not alloc.key_of and not alloc.grow(c, 9)
    off = BlockAllocator(4, 2)
    off.publish([0], keys)
    assert off.match(keys) == [] and not off.keys  # prefix caching off: nothing published, nothing found


def test_scheduler_starts_a_shared_prefix_from_the_cache_but_feeds_the_last_token():
    sched = Scheduler(BlockAllocator(16, 4, prefix_cache=True), max_batch=4, step_tokens=64)
    a = Seq(1, list(range(10)), Params(Sampling(4)))
    sched.add(a)
    assert [(s.rid, n) for s, n in sched.schedule()] == [(1, 10)]
    a.computed = 10
    sched.computed(a)  # blocks of tokens 0..3 and 4..7 are published, the partial third is not
    same = Seq(2, list(range(10)) + [50, 51], Params(Sampling(4)))
    exact = Seq(3, list(range(8)), Params(Sampling(4)))  # fully cached: its last block is fed again
    penalised = Seq(4, list(range(10)), Params(Sampling(4), repetition_penalty=1.2))
    for s in (same, exact, penalised):
        sched.add(s)
    plan = [(s.rid, s.computed, n) for s, n in sched.schedule()]
    assert plan == [(2, 8, 4), (3, 4, 4), (4, 0, 10)]
    assert same.table[:2] == a.table[:2] and exact.table[0] == a.table[0] and penalised.table[0] != a.table[0]
    assert sched.cached_tokens == 12 and sched.alloc.refs[a.table[0]] == 3


def test_engine_with_prefix_caching_equals_generate_and_skips_the_shared_prefill():
    """A first request computes a 24-token prefix; the next ones (some preempted by the small pool) start
    from its blocks and still give generate's tokens."""
    model = _tiny_model()
    runner = Runner(model, num_blocks=40, block_size=4)
    sched = Scheduler(BlockAllocator(40, 4, prefix_cache=True), max_batch=8, step_tokens=8)
    engine = Engine(runner, sched, TOK, Metrics(), distributed=False)
    prefix = list(range(40, 64))
    first = [(prefix + [1], 6, 0.0, 0)]
    rest = [(prefix + list(range(2, 2 + i)), 20 + 3 * i, 0.0 if i % 2 else 0.9, i) for i in range(1, 6)]
    outs = run_waves(engine, [first, rest])
    _assert_equals_generate(model, first + rest, outs)
    assert sched.cached_tokens >= 24 * len(rest) and sched.alloc.used == 0


def test_logprobs_ignore_padded_vocabulary_columns():
    z = torch.randn(5, 12)  # a head padded from 10 to 12 columns
    targets = torch.tensor([0, 3, 9, 2, 5])
    lp, ids, top = logprobs(z, targets, 3, None, vocab=10)
    want = torch.log_softmax(z[:, :10].double(), -1)
    assert torch.allclose(lp, want[torch.arange(5), targets])
    assert torch.allclose(top, want.topk(3).values) and torch.equal(ids, want.topk(3).indices)


class _StuckEngine:
    """An engine that accepts requests and never answers."""

    failed = None
    stop_reason = ""
    ready = threading.Event()

    def __init__(self):
        self.ready.set()
        self.cancelled: list[int] = []

    def submit(self, req) -> int:
        return 7

    def cancel(self, rid: int) -> None:
        self.cancelled.append(rid)

    def queue_depth(self) -> int:
        return 0


def test_request_timeout_gives_504_and_cancels():
    from fastapi.testclient import TestClient

    from plait.serve.protocol import Limits
    from plait.serve.server import Api
    from plait.serve.tokens import TokenizerInfo

    engine = _StuckEngine()
    limits = Limits("m", 64, 256, 16, 64)
    api = Api(engine, limits, TokenizerInfo(TOK, "/nonexistent", 64), Metrics(), max_queue=4, timeout=0.3)
    res = TestClient(api.app()).post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert res.status_code == 504 and res.json()["error"]["code"] == "request_timeout"
    assert engine.cancelled == [7]


def test_chat_templates_render_off_the_event_loop(monkeypatch):
    """A request's own template (trusted) is code of any cost: it renders in a worker thread, not on the loop
    that serves every other request."""
    import asyncio

    from fastapi.testclient import TestClient

    from plait.chat_template import ChatTemplate
    from plait.serve.protocol import Limits
    from plait.serve.server import Api
    from plait.serve.tokens import TokenizerInfo

    where: list[bool] = []  # per render: was an event loop running in its thread?
    real = ChatTemplate.render

    def spy(self, *args, **kwargs):
        try:
            asyncio.get_running_loop()
            where.append(True)
        except RuntimeError:
            where.append(False)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ChatTemplate, "render", spy)
    tokens = TokenizerInfo(TOK, "/nonexistent", 64, ChatTemplate(None, trust_request=True))
    api = Api(_StuckEngine(), Limits("m", 64, 256, 16, 64), tokens, Metrics(), max_queue=4, timeout=0.3)
    client = TestClient(api.app())
    own = "{% for m in messages %}{{ m.content }}{% endfor %}"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template": own}
    res = client.post("/v1/chat/completions", json={**body, "max_tokens": 2})
    assert res.status_code == 504  # parsed and submitted (the stuck engine never answers)
    res = client.post("/tokenize", json=body)
    assert res.status_code == 200 and res.json()["tokens"] == TOK.encode("hi"), res.text
    assert where == [False, False]


@pytest.mark.parametrize("body", [{"top_logprobs": 2}, {"logprobs": True}, {"stream_options": {"include_usage": 1}},
                                  # JSON's NaN passed every range check, to fail in the sampler
                                  {"temperature": float("nan")}, {"top_p": float("nan")},
                                  {"frequency_penalty": float("nan")}, {"logit_bias": {"1": float("nan")}}])
def test_protocol_refuses_malformed_fields(body):
    from plait.serve.protocol import ApiError, Limits, parse
    from plait.serve.tokens import TokenizerInfo

    with pytest.raises(ApiError):
        parse({"model": "m", "prompt": "hi", **body}, False, TokenizerInfo(TOK, "/nonexistent", 64),
              Limits("m", 64, 256, 16, 64))


def test_a_chat_without_max_tokens_gets_the_room_its_prompt_leaves_a_completion_16():
    from plait.serve.protocol import ApiError, Limits, parse
    from plait.serve.tokens import TokenizerInfo

    tokens = TokenizerInfo(TOK, "/nonexistent", 64)
    messages = [{"role": "user", "content": "hi"}]  # "<|user|>\nhi\n<|assistant|>\n": 26 bytes
    for limits, want in ((Limits("m", 64, 256, 63, 64), 38), (Limits("m", 64, 256, 20, 64), 20),
                         (Limits("m", 64, 256, 63, 30), 4)):
        chat = parse({"messages": messages}, True, tokens, limits)
        assert chat.params.sampling.max_new_tokens == want
        assert parse({"prompt": "hi"}, False, tokens, limits).params.sampling.max_new_tokens == 16
    # past the context: the message does not blame a max_tokens the request never set
    limits, long = Limits("m", 64, 256, 63, 64), [{"role": "user", "content": "x" * 40}]
    for body, chat, end in (({"messages": long}, True, "the prompt has 64 tokens, which leaves no room for a reply"),
                            ({"prompt": "x" * 60}, False, "60 tokens and max_tokens is 16 (the default of a request "
                                                          "that does not set it)"),
                            ({"prompt": "x" * 60, "max_tokens": 5}, False, "60 tokens and max_tokens is 5")):
        with pytest.raises(ApiError, match="maximum context length is 64 tokens") as info:
            parse(body, chat, tokens, limits)
        assert info.value.message.endswith(end), info.value.message


@pytest.mark.parametrize("message, param, code", [
    ({"role": "user"}, "messages[1].content", "missing_required_parameter"),
    ({"role": "user", "content": None}, "messages[1].content", "invalid_type"),
    ({"role": "assistant"}, "messages[1].content", "missing_required_parameter"),
    ({"role": "tool", "content": None, "tool_call_id": "1"}, "messages[1].content", "invalid_type"),
    ({"content": "hi"}, "messages[1].role", "missing_required_parameter"),
    ({"role": 3, "content": "hi"}, "messages[1].role", "invalid_type"),
    ("hi", "messages[1]", "invalid_type")])
def test_chat_messages_without_content_or_role_are_400s_naming_the_field(message, param, code):
    """A message without content (or with null content) would render as nothing, a silently different prompt:
    a 400 naming messages[i].content in OpenAI's words, on /v1/chat/completions and on /tokenize; an assistant
    message carrying tool_calls may leave its content out or null (the call is its reply)."""
    from fastapi.testclient import TestClient

    from plait.serve.protocol import ApiError, Limits, parse
    from plait.serve.server import Api
    from plait.serve.tokens import TokenizerInfo

    tokens, limits = TokenizerInfo(TOK, "/nonexistent", 64), Limits("m", 64, 256, 16, 64)
    messages = [{"role": "user", "content": "hi"}, message]
    with pytest.raises(ApiError) as info:
        parse({"messages": messages}, True, tokens, limits)
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code)
    assert param in info.value.message
    client = TestClient(Api(_StuckEngine(), limits, tokens, Metrics(), max_queue=4, timeout=0.3).app())
    res = client.post("/tokenize", json={"messages": messages})
    assert res.status_code == 400 and res.json()["error"]["param"] == param, res.text
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    for tool_call in (call, {**call, "content": None}):
        chat = parse({"messages": [*messages[:1], tool_call]}, True, tokens, limits)
        assert chat.prompts[0] == tokens.chat_ids({"messages": [*messages[:1], tool_call]})


@pytest.mark.parametrize("body, chat, needle", [
    ({"prompt": "hi"}, True, "prompt is a field of /v1/completions; /v1/chat/completions takes messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}, True, "prompt is a field of /v1/completions"),
    ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, False,
     "messages is a field of /v1/chat/completions; /v1/completions takes a prompt"),
    ({"prompt": "hi", "frobnicate": 1}, False, "frobnicate=1 is not supported by plait serve")])
def test_a_field_of_the_other_endpoint_is_refused_naming_the_endpoint_that_takes_it(body, chat, needle):
    """A prompt sent to the chat endpoint (or messages to the completions one) is a 400 that says where it goes,
    not that plait serve does not support it."""
    from plait.serve.protocol import ApiError, Limits, parse
    from plait.serve.tokens import TokenizerInfo

    with pytest.raises(ApiError) as info:
        parse(body, chat, TokenizerInfo(TOK, "/nonexistent", 64), Limits("m", 64, 256, 16, 64))
    assert (info.value.status, info.value.code) == (400, "unsupported") and needle in info.value.message


def test_tokenize_shows_each_ids_vocabulary_string_and_detokenize_gives_the_prompt_back(tmp_path):
    """/tokenize's token_strs are the vocabulary's strings (transformers' convert_ids_to_tokens, as vLLM), a
    special token's own text among them (decoding one id alone showed it as ""), and /detokenize gives back the
    text /tokenize took, special tokens included (a chat prompt's markers were dropped)."""
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer

    from data_util import EOS, bpe_folder
    from plait.serve.protocol import Limits
    from plait.serve.server import Api
    from plait.serve.tokens import TokenizerInfo
    from plait.tokenizers import FileTokenizer

    folder = bpe_folder(tmp_path / "bpe")
    tokens = TokenizerInfo(FileTokenizer(folder / "tokenizer.json"), str(folder), 64)
    client = TestClient(Api(_StuckEngine(), Limits("m", 64, 512, 16, 64), tokens, Metrics(), max_queue=4).app())
    text = f"the pipeline stage{EOS} café"
    out = client.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    ref = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert out["tokens"] == ref.encode(text).ids and EOS in out["token_strs"]
    assert out["token_strs"] == [ref.id_to_token(i) for i in out["tokens"]] and "Ġpipeline" in out["token_strs"]
    assert client.post("/detokenize", json={"tokens": out["tokens"]}).json() == {"prompt": text}
