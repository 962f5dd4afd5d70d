"""Model shapes and exact parameter counts (dense, GQA, GLU and mixture-of-experts transformers)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from plait.errors import ConfigError, FieldError, is_integer, is_number
from plait.hf_config import FAMILY_FIELDS, SLIDING, llama_fields, model_type
from plait.model_presets import PRESETS as TRAIN_PRESETS

#: the projections a per-head RMSNorm may follow (``Model.head_norms``): the queries and the keys
HEAD_NORMS = ("q", "k")


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer, described by its shapes only.

    ``bias``/``layernorm``/``learned_positions`` describe GPT-style models (biases in every linear,
    LayerNorm with a bias, a learned position table); Llama-style models leave them False. ``qkv_bias``: biases
    on the q, k and v projections alone (Qwen2's ``qkv_bias``).
    ``dropout``: the model trains with dropout (p > 0) after attention and the MLP, on the attention
    probabilities and on the embedding, as Megatron-LM's GPT does by default; each keeps a one-byte mask for the
    backward (Korthikanti et al. 2022, §4). Llama-style models (plait's, Meta's) have none, and a dropout of 0
    keeps no mask either (PyTorch's dropout returns its input at p = 0).
    ``balance_seq_len``: plait cuts a model into pipeline chunks before it sees data, balancing for the
    model's ``max_seq_len``; give it when that differs from the ``seq_len`` trained (None: the same).
    ``expert_capacity``: the rows an MoE layer's experts on one GPU are counted to receive under expert
    parallelism, as a multiple of what balanced routing sends them (``experts.received``; a capacity factor).
    ``head_norms``: the projections of ``HEAD_NORMS`` ("q", "k") whose every head an RMSNorm with a weight of
    ``head_dim`` normalises before RoPE (Qwen3's q/k norms). The model's family says so
    (``qk_norm`` in its config); the planner counts their weights and what they save.
    ``context``: the longest sequence the model itself takes (its ``max_seq_len`` or ``max_position_embeddings``)
    where its config says it; None where not known (the published presets: ``seq_len`` is what they trained at).
    ``sliding_window``: each query attends to at most this many keys, itself included (Mistral's window; None:
    plain causal attention). The attention then takes a mask of every query and key, which it saves for the
    backward; the planner counts the mask. ``window_layers``: how many of the layers take the window (Qwen2's and
    Qwen3's configs name them; None: every layer). A window as long as ``seq_len`` hides no key: plait's layer
    then attends causally without a mask, and the planner counts it so (``window_layer_share``).
    ``head_size``: each attention head's size where it is not ``hidden / n_heads`` (Qwen3's configs give
    ``head_dim`` apart); None: ``hidden / n_heads``. ``head_dim`` is the size either way, and the query heads'
    width ``q_width`` (``n_heads · head_dim``) sets the q and output projections, the attention scores' work and
    what the attention saves. A size equal to ``hidden / n_heads`` is kept as None (one Model for one shape).
    """

    n_layers: int
    hidden: int
    n_heads: int
    vocab: int
    seq_len: int
    ffn_hidden: int | None = None
    n_kv_heads: int | None = None
    glu: bool = False
    tied_embeddings: bool = False
    n_experts: int = 1
    top_k: int = 1
    bias: bool = False
    layernorm: bool = False
    learned_positions: bool = False
    dropout: bool = False
    name: str = "custom"
    balance_seq_len: int | None = None  # the length the runtime's balanced partition assumes (default seq_len)
    expert_capacity: float = 1.0
    head_norms: tuple[str, ...] = ()
    context: int | None = None
    sliding_window: int | None = None
    head_size: int | None = None
    window_layers: int | None = None
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        for field in ("n_layers", "hidden", "n_heads", "vocab", "seq_len", "n_experts", "top_k", "ffn_hidden",
                      "n_kv_heads", "head_size"):
            value = getattr(self, field)
            if value is not None and int(value) < 1:
                raise FieldError(field, value, "must be a positive integer")
        if self.head_size is not None and self.head_size * self.n_heads == self.hidden:
            object.__setattr__(self, "head_size", None)  # frozen: the one spelling of hidden / n_heads
        if self.head_size is None and self.hidden % self.n_heads:
            raise FieldError("n_heads", self.n_heads, "must divide {hidden}", {"hidden": self.hidden})
        if self.n_heads % self.kv_heads:
            raise FieldError("n_kv_heads", self.kv_heads, "must divide {n_heads}", {"n_heads": self.n_heads})
        if self.top_k > self.n_experts:
            raise FieldError("top_k", self.top_k, "must be at most {n_experts}", {"n_experts": self.n_experts})
        if not set(self.head_norms) <= set(HEAD_NORMS) or len(set(self.head_norms)) != len(self.head_norms):
            raise ConfigError(f"head_norms: {self.head_norms!r}; valid: distinct names of {', '.join(HEAD_NORMS)}")
        if self.sliding_window is not None and not (type(self.sliding_window) is int and self.sliding_window >= 1):
            raise FieldError("sliding_window", self.sliding_window, "must be a positive integer (or None: causal)")
        if self.window_layers is not None:
            if not (type(self.window_layers) is int and 0 <= self.window_layers <= self.n_layers):
                raise FieldError("window_layers", self.window_layers, "must be an integer from 0 to {n_layers}",
                                 {"n_layers": self.n_layers})
            if self.sliding_window is None and self.window_layers:
                raise FieldError("window_layers", self.window_layers, "needs a sliding_window")
            if self.window_layers == self.n_layers:
                object.__setattr__(self, "window_layers", None)  # frozen: the one spelling of every layer
        if not self.expert_capacity > 0:
            raise ConfigError(f"expert_capacity: must be positive (1: balanced routing), got {self.expert_capacity!r}")

    # ---- shapes -------------------------------------------------------------------------------
    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.hidden // self.n_heads

    @property
    def q_width(self) -> int:
        """The query heads' width, ``n_heads · head_dim`` (``hidden`` unless ``head_size`` says otherwise)."""
        return self.n_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 1

    @property
    def window_layer_share(self) -> float:
        """The share of the layers whose sliding window hides keys at ``seq_len`` (their attention takes the
        window's mask at cp = 1): 0 without a window, or with one at least as long as the sequence."""
        if self.sliding_window is None or self.sliding_window >= self.seq_len:
            return 0.0
        return (self.n_layers if self.window_layers is None else self.window_layers) / self.n_layers

    # ---- parameter counts ---------------------------------------------------------------------
    def attention_params(self) -> int:
        """Q is h×q and O q×h (q = ``q_width``, h unless ``head_size`` differs); K and V are h×(kv·d) with
        grouped-query attention (Ainslie et al. 2023)."""
        h, q, kv = self.hidden, self.q_width, self.kv_heads * self.head_dim
        weights = 2 * h * q + 2 * h * kv
        return weights + ((q + 2 * kv) if self.bias or self.qkv_bias else 0) + (h if self.bias else 0)

    def mlp_params(self) -> int:
        """One expert's MLP: up (and gate with a GLU, Shazeer 2020) h×f, down f×h."""
        h, f = self.hidden, self.ffn
        n_in = 2 if self.glu else 1
        return (n_in + 1) * h * f + ((n_in * f + h) if self.bias else 0)

    def norm_params(self) -> int:
        return 2 * self.hidden if self.layernorm else self.hidden

    def layer_norm_params(self) -> int:
        """The norms' weights of one layer: its two norms and its per-head norms (``head_norms``), none a matmul."""
        return 2 * self.norm_params() + len(self.head_norms) * self.head_dim

    def router_params(self) -> int:
        return self.hidden * self.n_experts if self.is_moe else 0

    def layer_params(self, active: bool = False) -> int:
        """Parameters of one transformer layer (``active``: only the top-k experts a token uses)."""
        experts = self.top_k if active else self.n_experts
        return (self.attention_params() + experts * self.mlp_params() + self.router_params()
                + self.layer_norm_params())

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + (self.seq_len * self.hidden if self.learned_positions else 0)

    def head_params(self) -> int:
        """The output projection (zero when tied to the embedding) plus the final norm."""
        return (0 if self.tied_embeddings else self.vocab * self.hidden) + self.norm_params()

    def n_params(self, active: bool = False) -> int:
        """Exact parameter count of the whole model."""
        return (self.n_layers * self.layer_params(active) + self.embedding_params()
                + self.head_params())

    # ---- constructors -------------------------------------------------------------------------
    def with_seq_len(self, seq_len: int | None) -> Model:
        return self if seq_len is None else replace(self, seq_len=int(seq_len))

    @classmethod
    def preset(cls, name: str, seq_len: int | None = None) -> Model:
        """A published model by name (see ``PRESETS``), or one of ``plait train``'s own presets (``tiny``,
        ``small``: see ``from_llama_config``); ``seq_len`` overrides its training length."""
        key = name.lower()
        if key in TRAIN_PRESETS:
            return cls.from_llama_config(TRAIN_PRESETS[key], seq_len, name=key)
        if key not in PRESETS:
            raise FieldError("model", name, f"unknown preset; valid: {', '.join([*PRESETS, *TRAIN_PRESETS])} (or a "
                                            "Hugging Face config.json)")
        return PRESETS[key].with_seq_len(seq_len)

    @classmethod
    def from_llama_config(cls, cfg: Any, seq_len: int | None = None, name: str = "llama") -> Model:
        """The model a ``plait.models.LlamaConfig`` (or its ``to_dict()``, or ``plait.hf_config.llama_fields`` of a
        folder's config.json: the same keys) describes, trained at ``seq_len`` tokens (default its
        ``max_seq_len``): its shapes (``head_dim``, where given, the ``head_size``) and the features of its layer
        the planner counts, ``qk_norm`` (Qwen3's per-head q/k norms: ``head_norms``), ``sliding_window`` (on the
        layers ``layer_types`` calls "sliding_attention": ``window_layers``; every layer without it) and
        ``qkv_bias``.
        Missing keys take LlamaConfig's defaults (``ffn_dim``: 2/3 of 4·dim rounded up to a multiple of 8). Every
        layer is a mixture-of-experts layer when ``n_experts > 1`` (``moe_every`` is not modelled); its
        ``capacity_factor`` c, where set, caps what an expert takes at c times its balanced share, the
        ``expert_capacity`` planned (dropless: balanced)."""
        _check_seq_len(seq_len)
        get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        dim, heads = int(get("dim", 64)), int(get("n_heads", 4))
        ffn = get("ffn_dim") or llama_ffn(dim)
        max_len = int(get("max_seq_len", 256))
        types = get("layer_types")
        return cls(n_layers=int(get("n_layers", 4)), hidden=dim, n_heads=heads, vocab=int(get("vocab_size", 256)),
                   seq_len=int(seq_len or max_len), ffn_hidden=int(ffn), n_kv_heads=get("n_kv_heads") or heads,
                   glu=True, tied_embeddings=bool(get("tie_embeddings", False)),
                   n_experts=int(get("n_experts", 1)), top_k=int(get("top_k", 1)), name=name,
                   balance_seq_len=max_len, expert_capacity=float(get("capacity_factor") or 1.0), context=max_len,
                   head_norms=HEAD_NORMS if get("qk_norm", False) else (), sliding_window=get("sliding_window"),
                   head_size=get("head_dim"), qkv_bias=bool(get("qkv_bias", False)),
                   window_layers=None if types is None else sum(t == SLIDING for t in types))

    @classmethod
    def from_hf_config(cls, path: str | Path, seq_len: int | None = None) -> Model:
        """Read a Hugging Face ``config.json`` (a file, or the folder holding it). A config of a family plait runs
        (a ``model_type`` of ``plait.hf_config.FAMILY_FIELDS``; ``llama`` where it names none) is
        read by the reader plait's models are built with (``llama_fields``) into ``from_llama_config``, the model
        ``plait train``'s prediction plans; others (GPT-2/NeoX style) by the shapes their keys give."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            cfg: dict[str, Any] = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model: cannot read a Hugging Face config from {str(path)!r}: {exc}") from exc
        if not isinstance(cfg, dict):
            raise ConfigError(f"model: {str(p)!r} holds a JSON {type(cfg).__name__}, not a Hugging Face config")
        name = p.parent.name or p.stem
        if model_type(cfg) in FAMILY_FIELDS:
            return _from_folder(cfg, seq_len, name, str(p))
        return _from_hf_dict(cfg, seq_len, name=name, source=str(p))


#: the dropout probabilities Hugging Face configs name (any above 0: the model trains with dropout)
DROPOUT_KEYS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout", "attention_dropout", "dropout",
                "hidden_dropout_prob", "attention_probs_dropout_prob")


#: where a Model setting of a Llama-like folder is read from in its config.json (``plait.hf_config``)
FOLDER_KEYS = {"vocab": "vocab_size", "hidden": "hidden_size", "n_layers": "num_hidden_layers",
               "n_heads": "num_attention_heads", "ffn_hidden": "intermediate_size", "n_kv_heads": "num_key_value_heads",
               "head_size": "head_dim", "n_experts": "num_local_experts", "top_k": "num_experts_per_tok",
               "sliding_window": "sliding_window"}
#: the longest training length a config's own context is planned at when no seq_len is given
MAX_DEFAULT_SEQ_LEN = 8192


def _missing(source: str, names: tuple[str, ...], field: str) -> ConfigError:
    return ConfigError(f"{source}: no {' or '.join(names)} (the model's {field}); plait reads the configs of "
                       f"model_type {', '.join(sorted(FAMILY_FIELDS))} and GPT-2/NeoX style ones")


def _from_folder(cfg: dict[str, Any], seq_len: int | None, name: str, source: str) -> Model:
    """The model of a config.json of a family plait runs, read as plait builds it (``plait.hf_config``); errors
    name the file's keys."""
    _check_seq_len(seq_len)
    try:
        fields = llama_fields(cfg)
    except KeyError as exc:
        field = next(f for f, key in FOLDER_KEYS.items() if key == exc.args[0])
        raise _missing(source, exc.args, field) from None
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    keys = dict(FOLDER_KEYS, **({} if seq_len else {"seq_len": "max_position_embeddings"}))
    try:
        return Model.from_llama_config(fields, seq_len or min(fields["max_seq_len"], MAX_DEFAULT_SEQ_LEN), name)
    except FieldError as exc:
        if exc.name not in keys:
            raise
        raise exc.in_file(source, keys) from None


def _check_seq_len(seq_len: int | None) -> None:
    """A training length given must be a positive count (0 would otherwise read as "the model's own")."""
    if seq_len is not None and not seq_len >= 1:
        raise FieldError("seq_len", seq_len, "must be a positive integer")


class _Config:
    """A config.json's numbers, each read under the first of its names the file has; ``keys`` remembers which
    name each of Model's settings came from, so that errors name the file's key (no flag was typed)."""

    def __init__(self, cfg: dict[str, Any], source: str):
        self.cfg, self.source = cfg, source
        self.keys: dict[str, str] = {}

    def optional(self, field: str, *names: str) -> int | None:
        key = next((k for k in names if self.cfg.get(k) is not None), None)
        if key is None:
            return None
        value = self.cfg[key]
        if not (is_integer(value) or is_number(value) and float(value).is_integer()):  # 4096.0 is 4096; true is not
            raise ConfigError(f"{self.source}: {key} = {value!r}: must be an integer")
        self.keys[field] = key
        return int(value)

    def number(self, field: str, *names: str, default: int | None = None) -> int:
        """The value under the first of ``names`` the file has, else ``default``, else an error naming them."""
        value = self.optional(field, *names)
        if value is None and default is not None:
            return default
        if value is None:
            raise _missing(self.source, names, field)
        return value


#: keys of configs outside plait's families that describe what ``Model`` does not model: key -> (the values that
#: leave the model as ``Model`` describes it, what the key describes)
UNMODELLED = {
    "n_shared_experts": ((None, 0), "shared experts beside the routed ones"),
    "num_shared_experts": ((None, 0), "shared experts beside the routed ones"),
    "shared_expert_intermediate_size": ((None, 0), "shared experts beside the routed ones"),
    "first_k_dense_replace": ((None, 0), "dense feed-forward layers among the experts' layers"),
    "moe_layer_freq": ((None, 1), "dense feed-forward layers among the experts' layers"),
    "decoder_sparse_step": ((None, 1), "dense feed-forward layers among the experts' layers"),
    "mlp_only_layers": ((None, []), "dense feed-forward layers among the experts' layers"),
    "kv_lora_rank": ((None,), "multi-head latent attention (low-rank keys and values)"),
    "q_lora_rank": ((None,), "multi-head latent attention (low-rank queries)"),
    "sliding_window": ((None,), "a sliding attention window (on which layers this config's family says)"),
    "layer_types": ((None,), "layers of several kinds"),
}


def _check_modelled(cfg: dict[str, Any], source: str) -> None:
    """ConfigError naming the first key of ``UNMODELLED`` whose value makes the config's model one ``Model`` does not
    describe (planning it without would plan another model, silently)."""
    for key, (neutral, what) in UNMODELLED.items():
        value = cfg.get(key)
        if value in neutral or (key == "sliding_window" and cfg.get("use_sliding_window") is False) or (
                key == "layer_types" and isinstance(value, list) and set(value) <= {"full_attention"}):
            continue
        raise ConfigError(f"{source}: {key} = {value!r}: {what}, which the planner does not model (it reads the "
                          f"configs of model_type {', '.join(sorted(FAMILY_FIELDS))} as plait builds them, others by "
                          "their shapes); remove the key from a copy of the file to plan the model without it")


def _from_hf_dict(cfg: dict[str, Any], seq_len: int | None, name: str, source: str = "config.json") -> Model:
    """The model of a config of a family plait does not run, from the shapes its keys give; a key of ``UNMODELLED``
    is refused. An MoE config's experts are ``moe_intermediate_size`` wide where it gives that width apart (Qwen2-MoE,
    DeepSeek: ``intermediate_size`` is then a dense layer's)."""
    _check_seq_len(seq_len)
    _check_modelled(cfg, source)
    kind = str(cfg.get("model_type", "")).lower()
    gpt_style = kind in {"gpt2", "gpt_neox", "gptj", "opt", "gpt_bigcode"}
    c = _Config(cfg, source)
    n_experts = c.number("n_experts", "num_local_experts", "num_experts", "n_routed_experts", default=1)
    ffn = ("moe_intermediate_size",) if n_experts > 1 and cfg.get("moe_intermediate_size") is not None else ()
    hidden = c.number("hidden", "hidden_size", "n_embd", "d_model")
    n_heads = c.number("n_heads", "num_attention_heads", "n_head")
    n_layers, vocab = c.number("n_layers", "num_hidden_layers", "n_layer"), c.number("vocab", "vocab_size")
    context = c.optional("context", "max_position_embeddings", "n_positions", "n_ctx")
    if not seq_len:  # the model's own length (capped), where no --seq-len was given
        seq_len = min(c.number("seq_len", "max_position_embeddings", "n_positions", "n_ctx", default=4096),
                      MAX_DEFAULT_SEQ_LEN)
    try:
        return Model(
            n_layers=n_layers, hidden=hidden, n_heads=n_heads, vocab=vocab,
            seq_len=int(seq_len),
            ffn_hidden=c.optional("ffn_hidden", *ffn, "intermediate_size", "n_inner", "ffn_dim"),
            n_kv_heads=c.number("n_kv_heads", "num_key_value_heads", default=n_heads),
            glu=not gpt_style,
            tied_embeddings=bool(cfg.get("tie_word_embeddings", gpt_style)),
            n_experts=n_experts, top_k=c.number("top_k", "num_experts_per_tok", "moe_top_k", default=1),
            head_size=c.optional("head_size", "head_dim"),
            bias=gpt_style, layernorm=gpt_style, learned_positions=kind in {"gpt2", "opt", "gpt_bigcode"},
            dropout=any(float(cfg.get(k) or 0) > 0 for k in DROPOUT_KEYS), name=name, context=context,
        )
    except FieldError as exc:
        if exc.name not in c.keys:  # a flag typed (--seq-len) keeps its own name
            raise
        raise exc.in_file(source, c.keys) from None


PRESETS: dict[str, Model] = {
    # Llama 3 (Dubey et al. 2024, Table 3) and the Hugging Face configs of Meta-Llama-3(.1).
    "llama3-8b": Model(32, 4096, 32, 128256, 8192, 14336, 8, glu=True, name="llama3-8b"),
    "llama3-70b": Model(80, 8192, 64, 128256, 8192, 28672, 8, glu=True, name="llama3-70b"),
    "llama3-405b": Model(126, 16384, 128, 128256, 8192, 53248, 8, glu=True, name="llama3-405b"),
    # GPT-3 175B (Brown et al. 2020, Table 2.1) with Megatron's padded vocabulary 51,200.
    "gpt3-175b": Model(96, 12288, 96, 51200, 2048, tied_embeddings=True, bias=True, layernorm=True,
                       learned_positions=True, dropout=True, name="gpt3-175b"),
    # Mixtral 8x7B (Jiang et al. 2024): 8 experts, top-2; 46.7B total, 12.9B active.
    "mixtral-8x7b": Model(32, 4096, 32, 32000, 4096, 14336, 8, glu=True, n_experts=8, top_k=2,
                          name="mixtral-8x7b"),
}


def llama_ffn(hidden: int) -> int:
    """Llama's FFN width: 2/3 of 4·hidden, rounded up to a multiple of 8 (``LlamaConfig``'s rule)."""
    return 8 * ((int(2 * 4 * hidden / 3) + 7) // 8)
