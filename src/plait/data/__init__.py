"""Prepared training data: ``plait data prepare`` into memory-mapped token shards, and the layout-independent
sample stream ``plait train --data`` reads (the global batch of a step is the same under every layout)."""

from __future__ import annotations

from plait.data.format import Prepared, is_prepared, open_prepared
from plait.data.prepare import prepare

__all__ = ["Prepared", "is_prepared", "open_prepared", "prepare"]
