"""How the documents of a run's data cut its rows, for the planner's step time of document masking
(``plait.plan.documents.DocumentLengths``; ``plait train --dry-run --document-mask`` and the run's prediction)."""

from __future__ import annotations

import numpy as np

from plait.data.format import Split
from plait.data.stream import TrainData, TrainSource


def starts(source: TrainSource) -> np.ndarray:
    """Where the documents of ``source``'s training stream start (int64, ascending, 0 first): a prepared dataset's
    document index; raw text tokenized here, the token after each end-of-document token."""
    split = source.train
    if isinstance(split, Split) and len(split.docs) > 1:
        return np.asarray(split.docs[:-1], dtype=np.int64)
    ids = np.asarray(split.read(0, split.tokens))
    return np.concatenate([[0], np.flatnonzero(ids[:-1] == source.eos) + 1]).astype(np.int64)


def window_documents(begins: np.ndarray, tokens: int, seq_len: int) -> tuple[float, float]:
    """(documents, the sum of their lengths squared) a row holds on average over the windows of ``seq_len`` input
    tokens a stream of ``tokens`` tokens is cut into (``[w·S, w·S + S)`` for ``w < (tokens - 1) // S``, as
    ``plait.data.stream`` reads them), the documents starting at ``begins``: a row's documents are the pieces
    between its ends and the document starts inside it, as ``plait.documents.Documents`` cuts it at each EOS."""
    windows = (tokens - 1) // seq_len
    end = windows * seq_len
    cuts = np.union1d(begins[(begins > 0) & (begins < end)], np.arange(0, end + 1, seq_len, dtype=np.int64))
    pieces = np.diff(cuts).astype(np.float64)
    return len(pieces) / windows, float((pieces * pieces).sum()) / windows


def row_documents(data: TrainData) -> tuple[float, float, str]:
    """``window_documents`` of ``data``'s sources, each weighted by its share of the samples (``Order``'s mixture),
    and the sentence that says so."""
    total = sum(s.weight for s in data.sources)
    count = squares = 0.0
    for s in data.sources:
        c, q = window_documents(starts(s), s.train.tokens, data.seq_len)
        count, squares = count + s.weight / total * c, squares + s.weight / total * q
    names = ", ".join(s.name for s in data.sources)
    return count, squares, f"the documents of {names}"
