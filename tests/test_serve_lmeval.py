"""lm-eval (as a library) against plait serve: local-completions with the server's tokenizer endpoints, offline."""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable

import pytest

from plait.generation.decode import Sampling, generate_ids
from plait.tokenizers import ByteTokenizer
from serve_util import log_softmax

pytestmark = pytest.mark.timeout(240)
TOK = ByteTokenizer()
GEN_TOKENS = 12


def _greedy(ref, eos: int) -> Callable[[str], str]:
    """The text plait generate continues a context with (GEN_TOKENS tokens, up to the end of sequence), each
    context's generated once."""
    @functools.cache
    def text(context: str) -> str:
        ids = generate_ids(ref, [TOK.encode(context)], Sampling(GEN_TOKENS))[0]
        return TOK.decode(ids[: ids.index(eos)] if eos in ids else ids)
    return text


def _docs(ref, greedy: Callable[[str], str]) -> list[dict]:
    """Questions whose greedy continuation holds a newline (so `until` cuts it), and two others."""
    candidates = [f"Q{i}: what is {i} + {i}?" for i in range(120)]
    outs = generate_ids(ref, [TOK.encode(c) for c in candidates], Sampling(GEN_TOKENS))  # a first sieve
    cut = list(itertools.islice((c for c, o in zip(candidates, outs, strict=True) if 10 in o and "\n" in greedy(c)),
                                2))  # the first two: their texts alone are generated
    assert cut, "no candidate continuation holds a newline"
    questions = cut + candidates[:2]
    return [{"question": q, "choices": [" four", f" {i}", " 2 + 2"], "label": i % 3} for i, q in enumerate(questions)]


def _task(folder, name: str, kind: str) -> None:
    data = folder / "data.jsonl"
    extra = ('doc_to_choice: "{{choices}}"\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n'
             if kind == "multiple_choice" else
             f'doc_to_target: "{{{{choices[label]}}}}"\ngeneration_kwargs:\n  until: ["\\n"]\n'
             f"  max_gen_toks: {GEN_TOKENS}\nmetric_list:\n  - metric: exact_match\n")
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files: {data}\ntest_split: train\n"
        f'output_type: {kind}\ndoc_to_text: "{{{{question}}}}"\n' + extra)


def test_lm_eval_generate_until_and_multiple_choice_equal_one_device(served, tmp_path, monkeypatch):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("OPENAI_API_KEY", "sk-plait-test")  # local-completions sends it as the bearer token
    import lm_eval
    from lm_eval.tasks import TaskManager

    greedy_text = _greedy(served.ref, served.eos)
    docs = _docs(served.ref, greedy_text)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    _task(tmp_path, "plait_mc", "multiple_choice")
    _task(tmp_path, "plait_gen", "generate_until")
    args = {"base_url": f"{served.server.url}/v1/completions", "model": "tiny", "num_concurrent": 4,
            "max_length": 128, "tokenizer_backend": "auto"}
    res = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["plait_mc", "plait_gen"],
                                  task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
                                  log_samples=True, bootstrap_iters=0)
    samples = res["samples"]
    assert len(samples["plait_mc"]) == len(docs) and len(samples["plait_gen"]) == len(docs)
    for s in samples["plait_mc"]:
        for (context, continuation), ((ll, greedy),) in zip(s["arguments"], s["resps"], strict=True):
            ctx, cont = TOK.encode(context), TOK.encode(continuation)
            lsm = log_softmax(served.ref, ctx + cont)
            want = sum(lsm[len(ctx) + j - 1, t].item() for j, t in enumerate(cont))
            assert abs(ll - want) < 1e-4, (context, continuation)
            assert greedy == all(lsm[len(ctx) + j - 1].argmax().item() == t for j, t in enumerate(cont))
    cut = 0
    for s in samples["plait_gen"]:
        context = s["arguments"][0][0]
        want = greedy_text(context)
        cut += "\n" in want
        assert s["resps"][0][0] == want.split("\n")[0], context
    assert cut >= 1
