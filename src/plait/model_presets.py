"""``plait train``'s own byte-level model presets (``tiny``, ``small``): plain LlamaConfig fields, no torch, shared by
the trainer (``plait.train.config``) and the planner (``plait.plan.Model.preset``)."""

from __future__ import annotations

from typing import Any

# byte-level presets (vocabulary 256); max_seq_len bounds --seq-len
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"vocab_size": 256, "dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 512},
    "small": {"vocab_size": 256, "dim": 256, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "max_seq_len": 1024},
}
