"""plait serve --dtype and plait generate --dtype: the weights and activations in the dtype asked for, under one
process and a tp 2 layout; any other dtype refused before launch."""

from __future__ import annotations

import openai
import pytest
import torch

from harness import PRELOAD
from plait.distributed.launch import run_world
from plait.generation.job import load_model
from plait.tokenizers import ByteTokenizer
from serve_util import Server, expected_ids, tiny_model

pytestmark = pytest.mark.timeout(240)
TOK = ByteTokenizer()


def test_a_bfloat16_server_says_so_and_gives_the_bfloat16_models_tokens(tmp_path):
    model_dir = tiny_model(tmp_path / "tiny")
    ref = load_model(str(model_dir), dtype=torch.bfloat16)[0]
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    server = Server(model_dir, tmp_path, "--dtype", "bfloat16", "--max-batch", "4")
    try:
        server.wait_healthy()
        assert "(tp 1, pp 1, bfloat16 on cpu, max batch 4," in server.output()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        prompt = TOK.encode("half the bytes, ")
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].token_ids == expected_ids(ref, prompt, 6)
    finally:
        server.proc.terminate()
        server.proc.wait(30)


def _dtypes(model_dir: str) -> list[str]:
    import plait

    with plait.init(2, 1, 1) as ctx:
        model = load_model(model_dir, ctx=ctx, dtype=torch.bfloat16)[0]
        return sorted({str(p.dtype) for p in model.parameters()})


def test_each_rank_of_a_layout_holds_its_slices_in_the_dtype(tmp_path):
    model_dir = tiny_model(tmp_path / "tiny")
    ranks = run_world(_dtypes, 2, str(model_dir), timeout_s=200, preload=PRELOAD)
    assert ranks == [["torch.bfloat16"], ["torch.bfloat16"]]


def test_plait_generate_decodes_in_the_dtype_asked_for(tmp_path, monkeypatch, capsys):
    from typer.testing import CliRunner

    from plait.cli.main import app
    from plait.generation import job

    model_dir = tiny_model(tmp_path / "tiny")
    monkeypatch.setenv("WORLD_SIZE", "1")
    ref = load_model(str(model_dir), dtype=torch.bfloat16)[0]
    want = TOK.decode(expected_ids(ref, TOK.encode("def "), 6))
    decoded_in: list[set[torch.dtype]] = []

    def loaded(*args, **kwargs):  # the model the job decodes with, as loaded
        out = load_model(*args, **kwargs)
        decoded_in.append({p.dtype for p in out[0].parameters()})
        return out

    monkeypatch.setattr(job, "load_model", loaded)
    payload = {"model": str(model_dir), "prompts": ["def "], "tp": 1, "pp": 1, "max_new_tokens": 6,
               "temperature": 0.0, "top_k": 0, "seed": 0, "dtype": "bfloat16"}
    assert job.generate_job(payload) == [want] and decoded_in == [{torch.bfloat16}]
    res = CliRunner().invoke(app, ["generate", "--model", str(model_dir), "--prompt", "def ", "--max-new-tokens", "6",
                                   "--dtype", "bfloat16"])  # one process: the job runs here
    assert res.exit_code == 0 and decoded_in == [{torch.bfloat16}] * 2, (res.output, decoded_in)
    res = CliRunner().invoke(app, ["generate", "--model", str(model_dir), "--dtype", "float64"])
    assert res.exit_code == 2 and "--dtype float64: choose float32, bfloat16 or float16" in res.output, res.output
