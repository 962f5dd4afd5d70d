"""plait generate's chat mode: --chat / --system / --messages rendered through the model's chat template as
transformers' apply_chat_template renders them, the reply equal to decoding those ids directly, under --pp 2 as in
one process; plait's own format for a folder without a template; errors named before anything launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from chat_templates import MISTRAL, QWEN25, template_folder
from plait.chat_template import PLAIT_SOURCE, chat_prompt
from plait.cli.main import app
from plait.generation import generate
from plait.generation.job import end_ids
from plait.models import Llama, LlamaConfig
from plait.tokenizers import ByteTokenizer, FileTokenizer

pytest.importorskip("transformers")
pytest.importorskip("jinja2")

SYSTEM = "You are a helpful assistant."
CORPUS = (SYSTEM + " hello world, what is the weather? the weather is hello and the world") * 8
NEW = 6


def _model_folder(path: Path, kind: str | None = "jinja", template: object = QWEN25) -> Path:
    """A small Llama saved beside a tokenizer carrying ``template`` (None: no tokenizer, bytes, no template)."""
    vocab = 256
    if kind is not None:
        template_folder(path, kind, template, None, "<|im_end|>", CORPUS)
        vocab = FileTokenizer(path / "tokenizer.json").vocab_size
    torch.manual_seed(0)
    Llama(LlamaConfig(vocab_size=vocab, dim=32, n_layers=2, n_heads=2, max_seq_len=128)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return _model_folder(tmp_path_factory.mktemp("chat") / "qwen")


def _reply(folder: Path, ids: list[int]) -> str:
    """The greedy reply to prompt ``ids``, decoded by the library directly (no CLI, no template)."""
    from plait.generation.job import load_model

    model, tok, _ = load_model(str(folder))
    out = generate(model, [ids], max_new_tokens=NEW, stop_ids=end_ids(str(folder)))[0]
    return tok.decode(out)


def test_a_chat_is_rendered_as_apply_chat_template_and_only_the_reply_printed(qwen, tmp_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(qwen)
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "what is the weather?"}]
    expected = _reply(qwen, list(hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False)))
    res = CliRunner().invoke(app, ["generate", "--model", str(qwen), "--system", SYSTEM, "--chat",
                                   "what is the weather?", "--max-new-tokens", str(NEW)])
    assert res.exit_code == 0, res.output
    assert "plait generate: chat template: chat_template.jinja" in res.output  # stderr, mixed in by CliRunner
    assert res.output.endswith(f"{expected}\n\n") and "what is the weather?" not in res.output
    # a --messages file of several turns is rendered whole, the same way
    turns = [*chat, {"role": "assistant", "content": "the weather is hello"}, {"role": "user", "content": "world?"}]
    (tmp_path / "chat.json").write_text(json.dumps(turns))
    expected = _reply(qwen, list(hf.apply_chat_template(turns, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False)))
    res = CliRunner().invoke(app, ["generate", "--model", str(qwen), "--messages", str(tmp_path / "chat.json"),
                                   "--max-new-tokens", str(NEW)])
    assert res.exit_code == 0 and res.output.endswith(f"{expected}\n\n"), res.output


def test_a_folder_without_a_template_gets_plaits_format_and_says_so(tmp_path):
    folder = _model_folder(tmp_path / "bytes", kind=None)
    expected = _reply(folder, ByteTokenizer().encode(chat_prompt([{"role": "user", "content": "hi"}])))
    res = CliRunner().invoke(app, ["generate", "--model", str(folder), "--chat", "hi", "--max-new-tokens", str(NEW)])
    assert res.exit_code == 0 and f"chat template: {PLAIT_SOURCE}" in res.output, res.output
    assert res.output.endswith(f"{expected}\n\n")


def test_chat_under_two_pipeline_stages_equals_one_process(qwen):
    """The two stages are launched as plait does (a process of ``plait generate``); the one process runs here."""
    args = ["generate", "--model", str(qwen), "--chat", "hello world", "--chat", "the weather?",
            "--max-new-tokens", str(NEW)]
    env = {**os.environ, "COLUMNS": "200"}
    one = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    two = subprocess.run([sys.executable, "-m", "plait.cli.main", *args, "--pp", "2"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert one.exit_code == 0 and two.returncode == 0, (one.output, two.stderr)
    assert one.stdout.count("\n\n") == 2 and two.stdout == one.stdout


def test_chat_errors_name_the_flag_before_launching(qwen, tmp_path):
    (tmp_path / "bad.json").write_text("[{")
    (tmp_path / "null.json").write_text(json.dumps([{"role": "user", "content": None}]))
    mistral = _model_folder(tmp_path / "mistral", "config", MISTRAL)
    for model, args, needle in (
            (qwen, ["--prompt", "hi", "--chat", "hi"], "error: --prompt and --chat: a prompt is continued as raw "
                                                       "text"),
            (qwen, ["--system", "be brief"], "error: --system 'be brief': it opens each --chat conversation, and "
                                             "none is given"),
            (qwen, ["--chat-template-kwargs", "{}"], "error: --chat-template-kwargs: read only for a conversation"),
            (qwen, ["--chat", "hi", "--chat-template-kwargs", "[1]"], "error: --chat-template-kwargs: an array, not "
                                                                      "a JSON object"),
            (qwen, ["--messages", str(tmp_path / "bad.json")], f"error: --messages {tmp_path / 'bad.json'}: not JSON"),
            (qwen, ["--messages", str(tmp_path / "null.json")], f"error: --messages {tmp_path / 'null.json'}: Invalid "
                                                               "type for 'messages[0].content'"),
            (qwen, ["--messages", str(tmp_path / "none.json")], f"error: --messages {tmp_path / 'none.json'}: cannot "
                                                               "read it"),
            (qwen, ["--chat", "hi", "--max-new-tokens", "120"],
             "error: --max-new-tokens 120: --chat 'hi' is 64 tokens, and 64 + 120 exceeds the model's 128 positions; "
             "give at most --max-new-tokens 64"),  # its template's default system message included
            (mistral, ["--chat", "hi", "--system", "be brief"], "error: --chat 'hi': the chat template failed: "
                                                                "TemplateError: Conversation roles must alternate")):
        res = CliRunner().invoke(app, ["generate", "--model", str(model), *args])
        assert res.exit_code == 2 and res.output.startswith(needle), (args, res.output)


def test_a_chat_gets_the_prompt_and_reply_plait_serve_gives_it(qwen, tmp_path):
    """The same conversation through a running ``plait serve`` (/tokenize with messages, and a greedy
    /v1/chat/completions) and through ``plait generate --chat``: the same prompt ids, the same reply."""
    import httpx

    from plait.cli.generate_chat import Conversation, chat_prompt_ids
    from plait.generation.job import source_config
    from serve_util import Server

    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello world?"}]
    config, _, tok = source_config(str(qwen))
    ids, _ = chat_prompt_ids(str(qwen), tok, config.max_seq_len, [Conversation("--chat", chat)], None, None)
    server = Server(qwen, tmp_path)
    try:
        server.wait_healthy(timeout=180)
        served = httpx.post(f"{server.url}/tokenize", json={"messages": chat}, timeout=60).json()["tokens"]
        body = {"model": qwen.name, "messages": chat, "max_tokens": NEW, "temperature": 0}
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    finally:
        server.kill()
    assert ids == [served], (ids, served)
    res = CliRunner().invoke(app, ["generate", "--model", str(qwen), "--system", SYSTEM, "--chat", "hello world?",
                                   "--max-new-tokens", str(NEW)])
    assert res.exit_code == 0, res.output
    assert "choices" in reply and reply["choices"][0]["message"]["content"], reply
    assert res.output.endswith(f"{reply['choices'][0]['message']['content']}\n\n"), (reply, res.output)
