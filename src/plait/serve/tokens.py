"""What the server tells about its tokenizer: special tokens and chat template of the model folder, /tokenize
and /tokenizer_info, and a chat request's prompt ids."""

from __future__ import annotations

from plait.chat_kwargs import merge_template_kwargs
from plait.chat_template import ChatError, ChatTemplate
from plait.tokenizers import Tokenizer, eos_ids


class TokenizerInfo:
    """The end-of-sequence ids (``eos``, else generation_config.json's, else config.json's), special tokens and
    chat template of a model folder (``chat``: a ChatTemplate; by default the folder's own). ``template_kwargs``:
    the variables every chat's template gets (--chat-template-kwargs), a request's chat_template_kwargs overriding
    them."""

    def __init__(self, tok: Tokenizer, folder: str, context: int, chat: ChatTemplate | None = None,
                 template_kwargs: dict | None = None, eos: tuple[int, ...] | None = None):
        self.eos: tuple[int, ...] = eos_ids(folder) if eos is None else eos
        self.tok, self.context = tok, context
        self.chat = chat or ChatTemplate(folder)
        self.template_kwargs = template_kwargs or {}
        self.special = {name: self.chat.special.get(name) for name in ("bos_token", "eos_token", "pad_token",
                                                                      "unk_token")}
        self.leading = tok.encode("")  # what the tokenizer adds to every text (a BOS), if anything

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; without the special tokens the tokenizer adds in front when asked."""
        ids = self.tok.encode(text)
        n = len(self.leading)
        if not add_special_tokens and n and ids[:n] == self.leading:
            ids = ids[n:]
        return ids

    def chat_ids(self, body: dict) -> list[int]:
        """The prompt ids of a chat request (or a /tokenize with messages): its messages through the chat
        template with vLLM's fields (add_generation_prompt, continue_final_message, chat_template,
        chat_template_kwargs over the server's as vLLM merges them: ``merge_template_kwargs``; tools, documents),
        tokenized without added special tokens unless add_special_tokens (as vLLM)."""
        from plait.serve.protocol import ApiError

        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ApiError(400, "chat_template_kwargs must be an object", "chat_template_kwargs")
        template = body.get("chat_template")
        if template is not None and not isinstance(template, str):
            raise ApiError(400, "chat_template must be a string (a template, or the name of one)", "chat_template")
        for name in ("add_generation_prompt", "add_special_tokens", "continue_final_message"):
            if body.get(name) is not None and not isinstance(body[name], bool):
                raise ApiError(400, f"{name} must be true or false", name)
        for name in ("tools", "documents"):
            if body.get(name) is not None and not (isinstance(body[name], list) and
                                                    all(isinstance(t, dict) for t in body[name])):
                raise ApiError(400, f"{name} must be a list of objects", name)
        generation = body.get("add_generation_prompt")
        try:
            text = self.chat.render(body.get("messages"), True if generation is None else generation,
                                    tools=body.get("tools") or None, documents=body.get("documents"),
                                    template=template, kwargs=merge_template_kwargs(self.template_kwargs, kwargs),
                                    continue_final=bool(body.get("continue_final_message")))
        except ChatError as exc:  # the request's messages or template: a 400
            raise ApiError(400, exc.message, exc.param, exc.code) from None
        return self.encode(text, bool(body.get("add_special_tokens") or False))

    def info(self) -> dict:
        """GET /tokenizer_info: the tokenizer's class, special tokens, context and chat template (as vLLM), and
        where the template came from."""
        return {"tokenizer_class": type(self.tok).__name__, **self.special, "model_max_length": self.context,
                "chat_template": self.chat.default, "chat_template_source": self.chat.source}


def model_tokens(model: str, tok: Tokenizer, context: int, template: str | None = None,
                 template_kwargs: str | None = None, trust_request_templates: bool = False) -> TokenizerInfo:
    """The TokenizerInfo of ``model`` (a plait checkpoint or a Hugging Face folder) whose tokenizer is ``tok``:
    its folder's chat template, or ``template`` (--chat-template), the variables of ``template_kwargs``
    (--chat-template-kwargs, JSON) and its end ids (plait.generation.job.end_ids). ``plait serve`` renders
    chat requests with it, and ``plait generate --chat`` its conversations."""
    from plait.chat_kwargs import parse_template_kwargs
    from plait.generation.job import end_ids, tokenizer_folder

    folder = tokenizer_folder(model)
    chat = ChatTemplate(folder, template, trust_request_templates)
    return TokenizerInfo(tok, folder, context, chat, parse_template_kwargs(template_kwargs), end_ids(model))
