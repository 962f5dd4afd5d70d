"""Fixtures shared by several test modules: one 8-rank world, one ``plait serve`` for the serving tests, and
the session's cache directory (never the real home)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest

import checks_pipeline
from harness import launch

KEY = "sk-plait-test"
KV_BUDGET = 120  # < the context (128): a request may fit the context yet not the pool


@pytest.fixture(scope="session", autouse=True)
def plait_cache(tmp_path_factory):
    """``PLAIT_CACHE_DIR`` for every test and the processes it starts, holding a synthetic profile of this
    host so that ``plait train`` does not calibrate in tests that do not test calibration."""
    from plait.calibrate import CACHE_ENV, cache_path, host_facts
    from profile_util import synthetic_profile

    root = tmp_path_factory.mktemp("plait-cache")
    old = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(root)
    facts = host_facts()
    synthetic_profile(facts).save(cache_path(facts))
    yield root
    if old is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = old


@pytest.fixture(scope="session")
def world8(tmp_path_factory):
    """One launch of 8 Gloo ranks: every schedule over tp2·pp2·dp2 (tests/test_pipeline.py) and ZeRO-1/2 over
    dp2·tp2·pp2 and dp4·tp2 (tests/test_zero.py); each rank returns its dict of check results."""
    return launch(checks_pipeline.rank_main, 8, None, str(tmp_path_factory.mktemp("zero")), timeout_s=600)


@dataclass
class Served:
    server: object  # serve_util.Server
    client: object  # openai.OpenAI
    ref: object  # the same model on one device (plait.models.Llama)
    eos: int  # the model folder's end-of-sequence id, chosen so that ...
    eos_prompt: list[int]  # ... the greedy continuation of this prompt reaches it
    eos_at: int  # as its (eos_at + 1)-th token, and not before

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {KEY}"}


#: a prompt whose 8 greedy tokens the served model's EOS is chosen not to be among (tests/test_serve.py)
PLAIN_PROMPT = "def main(): pass"


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    """The server, shared by every test that asks for it (starting one costs ~10 s)."""
    import openai

    from plait.generation.job import load_model
    from plait.train.data import ByteTokenizer
    from serve_util import Server, expected_ids, tiny_model

    tmp = tmp_path_factory.mktemp("serve")
    model_dir = tiny_model(tmp / "tiny", newlines=True)
    ref = load_model(str(model_dir))[0]
    prompt = ByteTokenizer().encode("the end is near")
    cont = expected_ids(ref, prompt, 24)
    plain = expected_ids(ref, ByteTokenizer().encode(PLAIN_PROMPT), 8)  # must run to its length: no EOS in it
    at = next(i for i in range(4, 24) if cont[i] not in cont[:i] and cont[i] not in plain)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": cont[at]}))
    server = Server(model_dir, tmp, "--pp", "2", "--max-batch", "8", "--kv-budget", str(KV_BUDGET),
                    "--max-tokens", "100", "--kv-block", "4", "--step-tokens", "16", "--api-key", KEY,
                    "--max-body-bytes", "65536")
    try:
        server.wait_healthy()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
        yield Served(server, client, ref, cont[at], prompt, at)
    finally:
        server.kill()
