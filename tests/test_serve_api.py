"""plait serve's request fields through the openai client: stops, n, sampling, penalties, logprobs, echo, usage."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from plait.chat_template import chat_prompt
from plait.tokenizers import ByteTokenizer
from serve_util import expected_ids, greedy_with, log_softmax

pytestmark = pytest.mark.timeout(240)
TOK = ByteTokenizer()
ABC = {str(c): 100 for c in b"abc"}  # a logit bias that makes the text a string over {a, b, c}


def test_eos_stops_unless_ignored_and_min_tokens_holds_it_back(served):
    client, ref, eos, prompt, at = served.client, served.ref, served.eos, served.eos_prompt, served.eos_at
    cont = expected_ids(ref, prompt, 24)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24).choices[0]
    assert out.token_ids == cont[: at + 1] and out.finish_reason == "stop"
    assert out.text == TOK.decode(cont[:at])  # the end-of-sequence token has no text
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, extra_body={"ignore_eos": True})
    assert out.choices[0].token_ids == cont and out.choices[0].finish_reason == "length"
    low = at + 3

    def ban_early(z, gen):
        return z.index_fill(0, torch.tensor([eos]), float("-inf")) if len(gen) < low else z

    want = greedy_with(ref, prompt, 24, ban_early)
    want = want[: want.index(eos) + 1] if eos in want else want
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, extra_body={"min_tokens": low})
    assert out.choices[0].token_ids == want and len(want) >= low and want[at] != eos


def test_stop_strings_and_stop_token_ids_cut_exactly(served):
    client = served.client
    ask = dict(model="tiny", prompt="stop here: ", max_tokens=20, logit_bias=ABC, temperature=1.0, seed=7)
    full = client.completions.create(**ask).choices[0]
    text, ids = full.text, full.token_ids
    assert len(text) == 20 and set(text) <= set("abc"), text
    i = next(i for i in range(2, 16) if text.find(text[i: i + 2]) == i)
    stop = text[i: i + 2]
    out = client.completions.create(**ask, stop=["zzz", stop]).choices[0]
    assert (out.text, out.finish_reason, out.token_ids) == (text[:i], "stop", ids[: i + 2])
    streamed = client.completions.create(**ask, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text[:i]
    out = client.completions.create(**ask, stop=stop, extra_body={"include_stop_str_in_output": True}).choices[0]
    assert out.text == text[: i + 2]
    j = next(j for j in range(2, 20) if ids.index(ids[j]) == j)
    out = client.completions.create(**ask, extra_body={"stop_token_ids": [ids[j]]}).choices[0]
    assert (out.text, out.finish_reason, out.token_ids) == (text[:j], "stop", ids[: j + 1])
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=20,
                                          logit_bias=ABC, temperature=1.0, seed=7, stop=stop)
    assert stop not in chat.choices[0].message.content and chat.choices[0].finish_reason in ("stop", "length")


def test_n_samples_use_seed_plus_i_and_no_seed_is_random(served):
    client, ref, eos = served.client, served.ref, served.eos
    prompt = "sample me"
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, n=3, temperature=1.0, seed=5)
    got = [c.token_ids for c in sorted(out.choices, key=lambda c: c.index)]
    assert got == [expected_ids(ref, TOK.encode(prompt), 8, 1.0, 0, 5 + i, eos=eos) for i in range(3)]
    assert len({tuple(g) for g in got}) == 3 and out.usage.completion_tokens == sum(len(g) for g in got)
    a, b = (client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=1.0).choices[0].token_ids
            for _ in range(2))
    assert a != b


def test_top_p_and_min_p_equal_generate(served):
    client, ref, eos = served.client, served.ref, served.eos
    for kw in ({"top_p": 0.5}, {"min_p": 0.3}, {"top_p": 0.9, "min_p": 0.05}):
        out = client.completions.create(model="tiny", prompt="nucleus", max_tokens=10, temperature=1.0, seed=3,
                                        top_p=kw.get("top_p", 1.0), extra_body={"min_p": kw.get("min_p", 0.0)})
        assert out.choices[0].token_ids == expected_ids(ref, TOK.encode("nucleus"), 10, 1.0, 0, 3, eos=eos, **kw)


def test_penalties_and_logit_bias_equal_a_reference(served):
    client, ref, eos = served.client, served.ref, served.eos
    prompt = TOK.encode("aaaa penalties")
    pres, freq, rep = 0.5, 1.5, 1.3

    def penalise(z, gen):
        counts = torch.bincount(torch.tensor(gen, dtype=torch.long), minlength=z.shape[0]).double()
        seen = torch.zeros(z.shape[0], dtype=torch.bool)
        seen[torch.tensor(prompt + gen)] = True
        z = torch.where(seen, torch.where(z > 0, z / rep, z * rep), z)
        return z - freq * counts - pres * (counts > 0).double()

    want = greedy_with(ref, prompt, 16, penalise)
    want = want[: want.index(eos) + 1] if eos in want else want
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, presence_penalty=pres,
                                    frequency_penalty=freq, extra_body={"repetition_penalty": rep})
    assert out.choices[0].token_ids == want
    assert want != expected_ids(ref, prompt, 16, eos=eos)  # the penalties changed something
    first = expected_ids(ref, prompt, 1)[0]
    want = greedy_with(ref, prompt, 6, lambda z, gen: z.index_add(0, torch.tensor([first, 65]),
                                                                   torch.tensor([-100.0, 3.0], dtype=torch.float64)))
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, logit_bias={str(first): -100, "65": 3},
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].token_ids == want and want[0] != first


def test_logprobs_equal_log_softmax_of_one_device(served):
    client, ref = served.client, served.ref
    prompt = TOK.encode("log probabilities")
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, logprobs=3,
                                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}).choices[0]
    lsm = log_softmax(ref, prompt + out.token_ids)
    for j, t in enumerate(out.token_ids):
        row = lsm[len(prompt) + j - 1]
        assert abs(out.logprobs.token_logprobs[j] - row[t].item()) < 1e-5
        best = row.topk(3)
        want = {f"token_id:{i}": v for i, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)}
        top = out.logprobs.top_logprobs[j]
        assert top.keys() == want.keys() and max(abs(top[k] - want[k]) for k in top) < 1e-5  # greedy: t is top 1
    assert out.logprobs.tokens == [f"token_id:{t}" for t in out.token_ids]
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, logprobs=0,
                                      extra_body={"ignore_eos": True}).choices[0]
    assert plain.logprobs.tokens == [TOK.decode([t]) for t in plain.token_ids]
    messages = [{"role": "user", "content": "chat logprobs"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, logprobs=True,
                                          top_logprobs=2, extra_body={"ignore_eos": True}).choices[0]
    ids = TOK.encode(chat_prompt(messages))
    lsm = log_softmax(ref, ids + chat.token_ids)
    for j, entry in enumerate(chat.logprobs.content):
        row = lsm[len(ids) + j - 1]
        assert abs(entry.logprob - row[chat.token_ids[j]].item()) < 1e-5
        want_top = row.topk(2).values.tolist()
        assert len(entry.top_logprobs) == len(want_top)
        # within 1e-5, not rounded to 5 places: a value near a rounding boundary rounds either way
        assert max(abs(e.logprob - v) for e, v in zip(entry.top_logprobs, want_top, strict=True)) < 1e-5


def test_echo_gives_prompt_logprobs_first_null(served):
    client, ref = served.client, served.ref
    prompt = TOK.encode("an echoed prompt, longer than one sixteen-token step")  # prefilled in chunks
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, logprobs=1, echo=True,
                                    extra_body={"ignore_eos": True}).choices[0]
    ids = prompt + out.token_ids
    lsm = log_softmax(ref, ids)
    lps = out.logprobs.token_logprobs
    assert out.text == TOK.decode(ids) and len(lps) == len(ids) and lps[0] is None
    assert out.logprobs.top_logprobs[0] is None
    assert max(abs(lps[j] - lsm[j - 1, ids[j]].item()) for j in range(1, len(ids))) < 1e-5
    streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=2, echo=True, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed).startswith(TOK.decode(prompt))


def test_stream_include_usage_ends_with_a_usage_chunk(served):
    client = served.client
    chunks = list(client.completions.create(model="tiny", prompt="usage", max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == 5 and all(c.usage is None for c in chunks[:-1])
    chat = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "u"}], max_tokens=3,
                                               stream=True, stream_options={"include_usage": True}, n=2,
                                               extra_body={"ignore_eos": True}))
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == 6
    chunks = list(client.completions.create(model="tiny", prompt="usage", max_tokens=4, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            extra_body={"ignore_eos": True}))
    assert [c.usage.completion_tokens for c in chunks] == [1, 2, 3, 4, 4, 4]  # 4 tokens, the finish, the total


def test_neutral_values_accepted_and_the_rest_refused(served):
    client = served.client
    messages = [{"role": "user", "content": "neutral"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, logprobs=False, n=1,
                                         top_p=1, response_format={"type": "text"})
    assert out.choices[0].logprobs is None
    for bad in ({"response_format": {"type": "json_object"}}, {"tools": [{"type": "function"}]}):
        with pytest.raises(openai.BadRequestError, match="not supported"):
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, **bad)
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"guided_json": {}})


def test_tokenizer_endpoints_version_api_key_and_body_limit(served):
    url, auth = served.server.url, served.headers
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert "eos_token" in info and info["model_max_length"] == 128 and "chat_template" in info
    tok = httpx.post(f"{url}/tokenize", json={"prompt": "hi", "add_special_tokens": False}).json()
    assert tok == {"count": 2, "max_model_len": 128, "tokens": [104, 105], "token_strs": None}
    assert httpx.post(f"{url}/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    assert httpx.post(f"{url}/tokenize", json={"tokens": 1}).status_code == 400
    assert httpx.get(f"{url}/version").json()["version"]
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    res = httpx.post(f"{url}/v1/completions", headers=auth, json={"model": "tiny", "prompt": "x" * 70000})
    assert res.status_code == 413 and res.json()["error"]["code"] == "request_too_large"


def test_omitted_model_and_chat_template_fields_as_vllm(served):
    url, auth, ref, eos = served.server.url, served.headers, served.ref, served.eos
    res = httpx.post(f"{url}/v1/completions", headers=auth, json={"prompt": "no model", "max_tokens": 3})
    assert res.status_code == 200 and res.json()["model"] == "tiny", res.text
    assert res.json()["choices"][0]["token_ids"] == expected_ids(ref, TOK.encode("no model"), 3, eos=eos)
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["chat_template_source"].startswith("plait's") and "<|assistant|>" in info["chat_template"]
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    tok = httpx.post(f"{url}/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert tok["tokens"] == list(b"<|user|>\na\nb\n")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for extra, param in (({"chat_template": "{{ messages }}"}, "chat_template"),
                         ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
                         ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs")):
        res = httpx.post(f"{url}/v1/chat/completions", headers=auth, json={**chat, **extra})
        assert res.status_code == 400 and res.json()["error"]["param"] == param, res.text
    res = httpx.post(f"{url}/v1/chat/completions", headers=auth, json={
        **chat, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none",
        "add_generation_prompt": False, "chat_template_kwargs": {"unused": 1}})
    want = expected_ids(ref, TOK.encode("<|user|>\nhi\n"), 2, eos=eos)
    assert res.status_code == 200 and res.json()["choices"][0]["token_ids"] == want, res.text
