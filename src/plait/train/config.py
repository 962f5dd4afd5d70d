"""``TrainConfig``: every ``plait train`` setting (flags = TOML keys), model presets, checks before launch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, get_args, get_origin, get_type_hints

from plait.errors import ConfigError, FieldError, check_output_path, divisors, is_integer, is_number, plain_numbers
from plait.model_presets import PRESETS
from plait.parallel_config import ParallelConfig, batch_split
from plait.parallel_config import field_names as parallel_field_names
from plait.words import counted, either

if TYPE_CHECKING:
    from plait.models.decoder import DecoderFamily
    from plait.models.llama import LlamaConfig

NONFINITE_POLICIES = ("stop", "skip")


#: the layout ``plait train`` uses when no flag says otherwise (4 local processes, 1F1B)
TRAIN_PARALLEL = ParallelConfig(tp=2, pp=2, dp=1, microbatches=4)


@dataclass
class TrainConfig:
    """Settings of one training run: the layout (``parallel``) and the run's own settings.

    Flat names are the CLI flags with ``-`` replaced by ``_`` and the TOML keys: ParallelConfig's fields
    (``tp``, ``schedule``, ...) and the fields below. ``from_dict``/``to_dict`` use that flat form.
    """

    parallel: ParallelConfig = TRAIN_PARALLEL
    model: str = "tiny"
    """tiny, small (fresh), or a Hugging Face folder with its *.safetensors (llama, mistral, qwen2, qwen3, mixtral,
    qwen3_moe)."""
    data: list[str] = field(default_factory=list)
    """A dataset made by `plait data prepare` (repeatable, each source once; WEIGHT:DIR mixes several, e.g.
    0.7:web 0.3:code), or plain text files or folders tokenized at start-up (up to --max-data-mb); default: the
    Python standard library's sources."""
    seq_len: int = 128
    """Tokens per sequence."""
    document_mask: bool = False
    """Keep attention inside each document of a packed sequence: a token attends only to the earlier tokens of its
    own document (documents end at the data's end-of-document token, recorded in its meta.json), positions restart
    at each document, and the target after each end-of-document token is left out of the loss; off: attention
    spans the whole sequence (docs/data.md, "Document masking")."""
    batch_size: int = 16
    """Global batch size in sequences."""
    steps: int = 300
    """Optimizer steps in total (a resumed run continues up to it)."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    warmup: int = 20
    """Linear warm-up steps before cosine decay."""
    clip: float = 1.0
    """Max global gradient norm (0: no clipping)."""
    weight_decay: float = 0.0
    """AdamW weight decay of matrices."""
    experts: int = 1
    """Experts per feed-forward layer of a preset (1: dense; > 1: mixture of experts)."""
    top_k: int = 1
    """Experts each token is routed to (mixture of experts)."""
    capacity_factor: float | None = None
    """Expert capacity C: each of a preset's experts takes at most ceil(C·seq-len·top-k/experts) tokens of a sequence
    and drops the rest to the residual (unset: dropless)."""
    aux_loss_coef: float | None = None
    """Weight of the load-balancing loss in the loss (unset: the preset's 0.01, a folder's router_aux_loss_coef)."""
    seed: int = 0
    """Seed of weights, data order and sampling."""
    checkpoint_dir: str = "plait-checkpoints"
    """Where checkpoints go (one folder per step, 'latest' points at the newest)."""
    checkpoint_every: int = 0
    """Save every N steps (0: only at the end)."""
    checkpoint_every_minutes: float = 0.0
    """Also save when this many minutes have passed since the last save (0: by step count only)."""
    keep: int = 3
    """Keep the latest K checkpoints in --checkpoint-dir, delete older ones (0: keep all)."""
    async_checkpoint: bool = True
    """Write checkpoints in the background: the step loop waits only while the state is copied (and for the
    previous save if it is still writing); the run's end waits for the last one."""
    resume: bool = False
    """Continue from the latest checkpoint in --checkpoint-dir (an error if there is none)."""
    auto_resume: bool = False
    """Continue from the latest complete checkpoint in --checkpoint-dir if there is one, else start fresh: the
    one command for the first start and every restart (torchrun --max-restarts, a scheduler's requeue)."""
    metrics: str | None = None
    """Append one JSON line per step (step, loss, tokens_per_s, ...) to this file."""
    tensorboard: str | None = None
    """Also log each step's numbers as TensorBoard events in this folder (the 'tensorboard' extra)."""
    wandb: str | None = None
    """Also log each step's numbers to this Weights & Biases project, offline unless WANDB_MODE=online (the
    'wandb' extra); --resume and --auto-resume continue the W&B run of the run they resume."""
    nproc: int | None = None
    """Processes to launch here (default tp x pp x dp)."""
    on_nonfinite: str = "stop"
    """On a NaN/inf loss: stop (default) or skip the step (no update: the learning-rate schedule counts updates)."""
    eval_every: int = 50
    """Held-out loss every N steps (0: only at the end)."""
    sample_tokens: int = 160
    """Length of the sample generated at the end (0: none), prompted by the start of a --data document (chat:
    a conversation up to the assistant's reply) or, on the default data, by "def "."""
    max_data_mb: float = 4.0
    """Tokenize at most this many million tokens of plain text at start-up (prepared datasets: no limit)."""
    trace_every: int = 10
    """Trace every N-th step to measure the bubble (0: never)."""
    cluster: str | None = None
    """Host profile from `plait calibrate` for the predicted step time, bubble and memory (default: this
    host's cached profile, measured on first use; 'none': no prediction)."""
    layout: str = "flags"
    """flags: the layout options (or their defaults); auto: the planner's fastest layout that fits this many
    processes (--nproc, or torchrun's world), choosing every layout option but --precision (give none of them)."""
    dry_run: bool = False
    """Check the settings and print what the run would cost on --cluster (the planner's step time, bubble
    and bytes per rank; a --metrics line too), then exit without launching."""

    def __post_init__(self) -> None:
        plain_numbers(self)

    def to_dict(self) -> dict:
        """The flat form: ParallelConfig's fields, then the run's."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "parallel"}
        return {**self.parallel.to_dict(), **own}

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        """From the flat form (missing keys take the defaults; ``TRAIN_PARALLEL`` for the layout)."""
        layout = {k: v for k, v in values.items() if k in parallel_field_names()}
        own = {k: v for k, v in values.items() if k not in layout}
        if "parallel" in own:
            raise ConfigError("TrainConfig.from_dict takes the flat form (tp=..., seq_len=...), not 'parallel'")
        return cls(parallel=replace(TRAIN_PARALLEL, **layout), **own)

    @property
    def world(self) -> int:
        return self.parallel.world


def run_field_names() -> list[str]:
    """The run's own settings (everything but the layout)."""
    return [f.name for f in fields(TrainConfig) if f.name != "parallel"]


def field_names() -> list[str]:
    """Every flat setting name: the layout's and the run's."""
    return parallel_field_names() + run_field_names()


def read_toml(path: str | Path) -> dict:
    """Keys of a TOML config file (``seq-len`` or ``seq_len``, optionally under a ``[train]`` table)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {p}: no such file")
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {p}: not valid TOML ({exc})") from None
    raw = raw.get("train", raw)
    known = set(field_names())
    hints = {**get_type_hints(ParallelConfig), **get_type_hints(TrainConfig)}
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ConfigError(f"--config {p}: unknown key {key!r}; valid keys: "
                              f"{', '.join(n.replace('_', '-') for n in sorted(known))}")
        out[name] = _toml_value(p, key, value, hints[name])
    return out


def _toml_value(path: Path, key: str, value, hint):
    """``value`` as the setting's type ``hint`` holds it (an integer is a number too; one string is a list of
    one), else a ConfigError naming the key and the type it needs."""
    optional = [t for t in get_args(hint) if t is not type(None)] if get_origin(hint) is not list else []
    kind = optional[0] if optional else hint
    if get_origin(kind) is list:
        if isinstance(value, (str, list)):
            return [str(v) for v in value] if isinstance(value, list) else [value]
        need = "a string or a list of strings"
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # nan and inf too: validate names them
            return float(value)
        need = "a number"
    elif kind is int:
        if is_integer(value):
            return value
        need = "an integer"
    elif kind is bool:
        if isinstance(value, bool):
            return value
        need = "true or false"
    else:
        if isinstance(value, str):
            return value
        need = "a string"
    raise ConfigError(f"--config {path}: {key} = {value!r}: must be {need}")


def toml_text(values: dict, header: str = "") -> str:
    """A ``plait train --config`` file of flat ``values`` (flag names as keys; None values left out)."""
    lines = [f"# {line}" for line in header.splitlines()]
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        elif isinstance(value, str):
            text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        else:
            raise ConfigError(f"{key}={value!r}: only booleans, numbers and strings are written")
        lines.append(f"{key.replace('_', '-')} = {text}")
    return "\n".join(lines) + "\n"


def model_config(cfg: TrainConfig, routing: bool = True) -> LlamaConfig:
    """The plain-model config of ``cfg.model`` (a preset name: a LlamaConfig; a Hugging Face folder: its family's),
    with the router flags (``routing=False``: without them)."""
    from plait.models import LlamaConfig
    from plait.train.routing import with_routing_flags

    if cfg.model in PRESETS:
        preset = PRESETS[cfg.model]
        if cfg.experts > 1:
            moe = LlamaConfig(**preset, n_experts=cfg.experts, top_k=cfg.top_k)
            return with_routing_flags(cfg, moe) if routing else moe
        return LlamaConfig(**preset)
    if cfg.experts > 1:
        raise ConfigError(f"--experts {cfg.experts}: mixture-of-experts layers are built for the presets "
                          f"({', '.join(PRESETS)}), not for a Hugging Face folder (a Mixtral folder has its own)")
    path = Path(cfg.model)
    if path.is_dir() and (path / "config.json").is_file():
        from plait.models.hf import folder_config

        folder = folder_config(path)[1]
        return with_routing_flags(cfg, folder) if routing else folder
    from plait.checkpoint import find_checkpoint

    if path.is_dir() and find_checkpoint(path) is not None:
        raise ConfigError(f"--model {cfg.model!r} is a plait checkpoint: continue its run with --resume "
                          f"--checkpoint-dir {cfg.model}, or start a new run from its weights with `plait export "
                          f"{cfg.model} DIR` and --model DIR")
    raise ConfigError(f"--model {cfg.model!r}: not a preset ({', '.join(PRESETS)}) nor a Hugging Face folder "
                      "with a config.json")


def model_family(cfg: TrainConfig) -> DecoderFamily:
    """The family adapter of ``cfg.model`` (llama for the presets)."""
    from plait.models.hf import folder_config
    from plait.models.registry import family_for_type

    return family_for_type("llama") if cfg.model in PRESETS else folder_config(cfg.model)[0]


def validate(cfg: TrainConfig, world: int | None = None) -> None:
    """Raise ConfigError naming the flag if ``cfg`` cannot run (no torch collective, no launch).

    The layout's own rules were checked when ``cfg.parallel`` was built (plait.parallel_config).
    """
    par = cfg.parallel
    for name in ("seq_len", "batch_size", "steps"):
        if not is_integer(getattr(cfg, name)) or getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(cfg, name)!r}: must be a positive integer")
    check_nproc(cfg)
    if cfg.experts < 1 or cfg.top_k < 1 or cfg.top_k > cfg.experts:
        raise ConfigError(f"--experts {cfg.experts} --top-k {cfg.top_k}: need experts >= 1 and 1 <= top-k <= experts")
    for name in ("warmup", "checkpoint_every", "checkpoint_every_minutes", "keep", "eval_every", "sample_tokens",
                 "trace_every", "clip", "weight_decay"):  # 0 turns each off; below 0 is no setting
        if not (is_number(getattr(cfg, name)) and getattr(cfg, name) >= 0):  # nor is nan or inf (from a flag)
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be {_finite(getattr(cfg, name))}"
                              ">= 0")
    if not (is_number(cfg.max_data_mb) and cfg.max_data_mb > 0):
        raise ConfigError(f"--max-data-mb {cfg.max_data_mb}: must be {_finite(cfg.max_data_mb)}> 0 (million tokens of "
                          "plain text to read)")
    if cfg.layout not in ("flags", "auto"):
        raise ConfigError(f"--layout {cfg.layout!r}: choose 'flags' or 'auto'")
    if cfg.resume and cfg.auto_resume:
        raise ConfigError("--resume, --auto-resume: choose one (--resume needs a checkpoint; --auto-resume starts "
                          "fresh when there is none)")
    from plait.train.restart import check_checkpoint_dir

    check_checkpoint_dir(cfg)
    if cfg.on_nonfinite not in NONFINITE_POLICIES:
        raise ConfigError(f"--on-nonfinite {cfg.on_nonfinite!r}: choose 'stop' or 'skip'")
    if not (is_number(cfg.lr) and cfg.lr > 0):
        raise ConfigError(f"--lr {cfg.lr}: must be {_finite(cfg.lr)}> 0")
    if world is None and par.dp == -1 and not cfg.nproc:
        raise ConfigError("--dp -1 infers dp from the world size: give --nproc (or run under torchrun)")
    world = world if world is not None else (cfg.nproc or par.world)
    par = par.resolve(world) if par.dp == -1 else par
    if par.world != world:
        cp = f" x --cp {par.cp}" if par.cp > 1 else ""
        raise ConfigError(f"--tp {par.tp}{cp} x --pp {par.pp} x --dp {par.dp} = {par.world} processes, but the world "
                          f"has {world} (--nproc or torchrun); make the product equal {world}")
    per_replica, fits = batch_split(cfg.batch_size, par.dp)
    if not per_replica or per_replica % par.num_microbatches:
        unit = par.dp * par.num_microbatches
        other = ""
        if per_replica:  # a count of micro-batches that splits each replica's share
            other = (f"; or --microbatches {either([str(m) for m in fits])}, which "
                     f"{'divides' if len(fits) == 1 else 'divide'} a replica's {counted(per_replica, 'sequence')}")
        raise ConfigError(f"--batch-size {cfg.batch_size} must be a multiple of --dp x --microbatches = {par.dp} x "
                          f"{par.num_microbatches} = {unit} (each replica's sequences cut into equal micro-batches): "
                          f"valid --batch-size {unit}, {2 * unit}, {3 * unit}, ...{other}")
    par.check_seq_len(cfg.seq_len)
    if par.sequence_parallel and cfg.seq_len % par.tp:
        raise ConfigError(f"--seq-len {cfg.seq_len} must be a multiple of --tp {par.tp} with --sequence-parallel")
    _validate_model(cfg)
    from plait.data.stream import check_entries
    from plait.train.logs import check_extras

    check_extras(cfg.tensorboard, cfg.wandb)
    check_entries(cfg.data, cfg.model, model_config(cfg).vocab_size, cfg.seq_len, cfg.document_mask)
    check_raw_lengths(cfg)


#: raw text up to this size is tokenized once more before launch to check its length (well under a second);
#: a larger input holds far more than one sequence (tokens are a few bytes each), and its workers check it
RAW_CHECKED_BYTES = 1 << 20


def _finite(value) -> str:
    """'a finite number ' where ``value`` is a nan or an infinity, which a bound alone does not rule out."""
    return "a finite number " if isinstance(value, float) and not math.isfinite(value) else ""


def check_raw_lengths(cfg: TrainConfig) -> None:
    """ConfigError naming the path, its training tokens and --seq-len when raw text given to --data holds no
    ``seq_len + 1``-token window (prepared datasets are checked by ``check_entries``)."""
    from plait.data import is_prepared
    from plait.data.raw import raw_inputs, raw_source
    from plait.data.stream import check_length, parse_entry

    for entry in cfg.data:
        weight, path = parse_entry(entry)
        if not is_prepared(path) and sum(s.bytes for s in raw_inputs(path, cfg.model)) <= RAW_CHECKED_BYTES:
            check_length(raw_source(path, weight, cfg.model, cfg.max_data_mb), cfg.seq_len)


def check_nproc(cfg: TrainConfig) -> None:
    """--nproc, when given, is a positive process count (never read as 'not given')."""
    if cfg.nproc is not None and (not is_integer(cfg.nproc) or cfg.nproc < 1):
        raise ConfigError(f"--nproc {cfg.nproc!r}: must be a positive integer (or left out: tp x cp x pp x dp)")


def check_outputs(cfg: TrainConfig) -> None:
    """--checkpoint-dir and --tensorboard must be folders that can be made, --metrics a file that can be: a path
    through a file, or a file where a folder goes, fails here instead of at the first save or step."""
    check_output_path("--checkpoint-dir", cfg.checkpoint_dir, folder=True)
    check_output_path("--metrics", cfg.metrics, folder=False)
    check_output_path("--tensorboard", cfg.tensorboard, folder=True)


def _validate_model(cfg: TrainConfig) -> None:
    """The model against the layout: context, layers per chunk, TP shapes, experts, vocabulary."""
    from plait.tokenizers import check_fits, tokenizer_for
    from plait.train.routing import check_routing_flags

    check_routing_flags(cfg, model_config(cfg, routing=False), cfg.model in PRESETS)  # before a config refuses them
    par, mcfg = cfg.parallel, model_config(cfg)
    if cfg.seq_len > mcfg.max_seq_len:
        contexts = ", ".join(f"{name} {p['max_seq_len']}" for name, p in PRESETS.items())
        raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len {mcfg.max_seq_len} (--model "
                          f"{cfg.model}): valid --seq-len 1 to {mcfg.max_seq_len}; the presets' contexts are "
                          f"{contexts}, a --model folder's config.json sets its own (max_position_embeddings)")
    chunks = par.pipeline_schedule().num_stages
    if mcfg.n_layers < chunks:
        raise ConfigError(f"--pp {par.pp} (x {chunks // par.pp} chunks per rank) needs at least {chunks} layers; "
                          f"--model {cfg.model} has {mcfg.n_layers}")
    try:
        model_family(cfg).check_tp(mcfg, par.tp)
    except ConfigError as exc:
        raise ConfigError(f"--tp {par.tp} does not fit --model {cfg.model}: {exc}") from None
    if par.ep > 1 or par.expert_tp:
        from plait.experts import check_experts

        if mcfg.n_experts < 2:
            raise ConfigError(f"--ep {par.ep}{' --expert-tp' if par.expert_tp else ''} needs a mixture-of-experts "
                              "model: pass --experts E (E >= 2) or a Mixtral or Qwen3-MoE folder")
        try:
            check_experts(mcfg.n_experts, par.ep)
        except FieldError:
            if cfg.model in PRESETS:
                raise  # the experts are --experts
            raise ConfigError(f"--ep {par.ep}: must divide the {mcfg.n_experts} experts of --model {cfg.model}; "
                              f"valid: {divisors(mcfg.n_experts)}") from None
    check_fits(tokenizer_for(cfg.model), mcfg.vocab_size, cfg.model)  # the text encoding fits the vocabulary
    if cfg.model not in PRESETS:
        from plait.models.hf import HFWeights

        HFWeights(cfg.model).check_shapes()

