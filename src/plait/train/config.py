"""``TrainConfig``: every ``plait train`` setting (flags = TOML keys), model presets, checks before launch."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from plait.errors import ConfigError

# byte-level presets (vocabulary 256); max_seq_len bounds --seq-len
PRESETS: dict[str, dict] = {
    "tiny": {"vocab_size": 256, "dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 512},
    "small": {"vocab_size": 256, "dim": 256, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "max_seq_len": 1024},
}
NONFINITE_POLICIES = ("stop", "skip")


@dataclass
class TrainConfig:
    """Settings of one training run; field names are the CLI flags with ``-`` replaced by ``_``."""

    tp: int = 2
    pp: int = 2
    dp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 4
    virtual_stages: int = 1
    sequence_parallel: bool = False
    model: str = "tiny"
    data: list[str] = field(default_factory=list)
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 300
    lr: float = 3e-3
    warmup: int = 20
    clip: float = 1.0
    weight_decay: float = 0.0
    precision: str = "fp32"
    zero: int = 0
    experts: int = 1
    top_k: int = 1
    ep: int = 1
    expert_tp: bool = False
    seed: int = 0
    checkpoint_dir: str = "plait-checkpoints"
    checkpoint_every: int = 0
    resume: bool = False
    metrics: str | None = None
    nproc: int | None = None
    on_nonfinite: str = "stop"
    eval_every: int = 50
    sample_tokens: int = 160
    max_data_mb: float = 4.0
    trace_every: int = 10

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        return cls(**values)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


def field_names() -> list[str]:
    return [f.name for f in fields(TrainConfig)]


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
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ConfigError(f"--config {p}: unknown key {key!r}; valid keys: "
                              f"{', '.join(n.replace('_', '-') for n in sorted(known))}")
        out[name] = [str(v) for v in value] if name == "data" and isinstance(value, list) else value
    if isinstance(out.get("data"), str):
        out["data"] = [out["data"]]
    return out


def model_config(cfg: TrainConfig):
    """The LlamaConfig of ``cfg.model`` (a preset name or a Hugging Face folder)."""
    from plait.models import LlamaConfig

    if cfg.model in PRESETS:
        moe = {"n_experts": cfg.experts, "top_k": cfg.top_k} if cfg.experts > 1 else {}
        return LlamaConfig(**PRESETS[cfg.model], **moe)
    if cfg.experts > 1:
        raise ConfigError(f"--experts {cfg.experts}: mixture-of-experts layers are built for the presets "
                          f"({', '.join(PRESETS)}), not for a Hugging Face folder")
    path = Path(cfg.model)
    if path.is_dir() and (path / "config.json").is_file():
        import json

        from plait.models.hf import config_from_hf

        return config_from_hf(json.loads((path / "config.json").read_text()))
    raise ConfigError(f"--model {cfg.model!r}: not a preset ({', '.join(PRESETS)}) nor a Hugging Face Llama "
                      "folder with a config.json")


def validate(cfg: TrainConfig, world: int | None = None) -> None:
    """Raise ConfigError naming the flag if ``cfg`` cannot run (no torch collective, no launch)."""
    from plait.schedules import SCHEDULE_NAMES

    for name in ("tp", "pp", "dp", "microbatches", "virtual_stages", "seq_len", "batch_size"):
        if not isinstance(getattr(cfg, name), int) or getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(cfg, name)!r}: must be a positive integer")
    if cfg.experts < 1 or cfg.top_k < 1 or cfg.top_k > cfg.experts:
        raise ConfigError(f"--experts {cfg.experts} --top-k {cfg.top_k}: need experts >= 1 and 1 <= top-k <= experts")
    if cfg.ep > 1:
        from plait.experts import check_experts

        if cfg.experts < 2:
            raise ConfigError(f"--ep {cfg.ep} needs a mixture-of-experts model: pass --experts E (E >= 2)")
        if (cfg.dp * cfg.tp) % cfg.ep:
            raise ConfigError(f"--ep {cfg.ep} must divide dp*tp={cfg.dp * cfg.tp} (experts are spread over the "
                              "dp x tp ranks of a stage)")
        check_experts(cfg.experts, cfg.ep)
    if cfg.expert_tp and (cfg.experts < 2 or cfg.dp % cfg.ep):
        raise ConfigError(f"--expert-tp needs --experts E (E >= 2) and --ep {cfg.ep} dividing dp={cfg.dp} (each "
                          "expert is split over TP, so EP spans data-parallel replicas)")
    if cfg.steps < 0 or cfg.checkpoint_every < 0:
        raise ConfigError("--steps and --checkpoint-every must be >= 0")
    if cfg.schedule not in SCHEDULE_NAMES:
        raise ConfigError(f"--schedule {cfg.schedule!r}: unknown; choose one of {', '.join(SCHEDULE_NAMES)}")
    if cfg.on_nonfinite not in NONFINITE_POLICIES:
        raise ConfigError(f"--on-nonfinite {cfg.on_nonfinite!r}: choose 'stop' or 'skip'")
    if cfg.zero not in (0, 1, 2):
        raise ConfigError(f"--zero {cfg.zero}: choose 0 (replicated optimizer state), 1 (ZeRO-1: masters and "
                          "optimizer state sharded over dp) or 2 (ZeRO-2: gradients sharded too)")
    if cfg.precision not in ("fp32", "bf16"):
        raise ConfigError(f"--precision {cfg.precision!r}: choose fp32 or bf16")
    if not cfg.lr > 0:
        raise ConfigError(f"--lr {cfg.lr}: must be > 0")
    world = world if world is not None else (cfg.nproc or cfg.world)
    if cfg.world != world:
        raise ConfigError(f"--tp {cfg.tp} x --pp {cfg.pp} x --dp {cfg.dp} = {cfg.world} processes, but the world "
                          f"has {world} (--nproc or torchrun); make the product equal {world}")
    per_replica = cfg.batch_size // cfg.dp if cfg.batch_size % cfg.dp == 0 else 0
    if not per_replica or per_replica % cfg.microbatches:
        raise ConfigError(f"--batch-size {cfg.batch_size} must be a multiple of --dp x --microbatches = "
                          f"{cfg.dp * cfg.microbatches}")
    if cfg.sequence_parallel and cfg.seq_len % cfg.tp:
        raise ConfigError(f"--seq-len {cfg.seq_len} must be a multiple of --tp {cfg.tp} with --sequence-parallel")
    mcfg = model_config(cfg)
    if cfg.seq_len > mcfg.max_seq_len:
        raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len {mcfg.max_seq_len}")
    chunks = cfg.pp * cfg.virtual_stages * (2 if cfg.schedule in ("zbv", "dualpipev") else 1)
    if mcfg.n_layers < chunks:
        raise ConfigError(f"--pp {cfg.pp} (x {chunks // cfg.pp} chunks per rank) needs at least {chunks} layers; "
                          f"--model {cfg.model} has {mcfg.n_layers}")
    from plait.tensor_parallel.plan import check_llama_tp

    try:
        check_llama_tp(mcfg, cfg.tp)
    except ConfigError as exc:
        raise ConfigError(f"--tp {cfg.tp} does not fit --model {cfg.model}: {exc}") from None
    for path in cfg.data:
        if not os.path.exists(path):
            raise ConfigError(f"--data {path}: no such file or directory")
    if mcfg.vocab_size < 256 and not _has_tokenizer(cfg.model):
        raise ConfigError(f"--model {cfg.model}: vocabulary {mcfg.vocab_size} < 256 cannot hold bytes and the "
                          "folder has no tokenizer.json")


def _has_tokenizer(model: str) -> bool:
    return (Path(model) / "tokenizer.json").is_file()
