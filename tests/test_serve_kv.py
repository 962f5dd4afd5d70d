"""A serving step's setup: the paged KV cache's built once per forward and shared by every layer, no device reads
per layer, one read for a group's greedy tokens."""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from plait.devices import HostSyncCounter
from plait.generation.decode import Sampling
from plait.models import Llama, LlamaConfig
from plait.serve.runner import Row, Runner, Step
from plait.serve.sampling import Params

LAYERS = 3


class Ops(TorchDispatchMode):
    """Counts the ATen operations run inside it, by name."""

    def __init__(self):
        super().__init__()
        self.count: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _runner() -> tuple[Llama, Runner, list[dict]]:
    """A greedy runner whose caches record, per call, the positions and mask each layer was handed."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=LAYERS, n_heads=4, n_kv_heads=2,
                              max_seq_len=64)).eval()
    runner = Runner(model, num_blocks=16, block_size=4)
    seen: list[dict] = []
    for name, cache in runner.caches.items():
        positions, append = cache.positions, cache.append

        def rec_positions(s, name=name, positions=positions):
            pos = positions(s)
            seen.append({"layer": name, "pos": pos})
            return pos

        def rec_append(k, v, name=name, append=append):
            out = append(k, v)
            seen[-1]["mask"] = out[2]
            return out

        cache.positions, cache.append = rec_positions, rec_append
    return model, runner, seen


def _count_syncs(runner: Runner, method: str) -> list[int]:
    """Host reads of tensor values inside each call of ``runner.dec.run`` (a chunk's forward) or of
    ``runner._outputs`` (a group's sampling); on CPU every value read counts."""
    counts: list[int] = []
    owner = runner.dec if method == "run" else runner
    call = getattr(owner, method)

    def counted(*args):
        with HostSyncCounter(runner.dec.device) as counter:
            out = call(*args)
        counts.append(counter.total)
        return out

    setattr(owner, method, counted)
    return counts


def test_every_layer_of_a_forward_shares_one_view_built_once_and_reads_no_device_value():
    model, runner, seen = _runner()
    syncs, sampling = _count_syncs(runner, "run"), _count_syncs(runner, "_outputs")
    prompts = [[5, 9, 2, 7, 1, 3], [4, 4, 8, 1, 2, 6]]
    tables = [[0, 1], [2, 3]]
    params = Params(Sampling(8, 0.0))
    out = runner.execute(Step(new=[(0, params), (1, params)],
                              rows=[Row(i, p, 0, tables[i], True) for i, p in enumerate(prompts)]))
    assert runner.batch.builds == 1 and len(seen) == LAYERS  # prompts of one length: one row group
    assert all(e["mask"] is None for e in seen)  # fresh rows: plain causal attention
    tokens = [[*p, o[0]] for p, o in zip(prompts, out, strict=True)]
    # one decode step of both rows (one group) and a prompt chunk of a third sequence (a group of its own)
    seen.clear()
    rows = [Row(i, t[-1:], 6, tables[i], True) for i, t in enumerate(tokens)] + [Row(2, [3, 3, 3], 2, [4, 5], False)]
    out = runner.execute(Step(new=[(2, params)], rows=rows))
    assert runner.batch.builds == 3, "one view per row group, not per layer"
    groups = [seen[:LAYERS], seen[LAYERS:]]  # the prompt chunk's group runs first
    for group in groups:
        assert len(group) == LAYERS and len({e["layer"] for e in group}) == LAYERS
        assert all(e["pos"] is group[0]["pos"] and e["mask"] is group[0]["mask"] for e in group)
    assert groups[0][0]["pos"].tolist() == [[2, 3, 4]] and groups[1][0]["pos"].tolist() == [[6], [6]]
    assert groups[0][0]["mask"].shape == (1, 1, 3, 5) and groups[1][0]["mask"].shape == (2, 1, 1, 7)
    assert syncs[1:] == [0, 0], f"host reads of device values in a forward with cached positions: {syncs}"
    assert sampling[-1] == 1, f"greedy rows: one read of the device for the group, not one a row: {sampling}"
    for t, o in zip(tokens, out[:2], strict=True):  # greedy: the paged forward's token is the full forward's
        assert o[0] == int(model(torch.tensor([t]))[0, -1].argmax())


def test_prompt_chunks_share_a_padded_forward_and_give_each_rows_own_tokens():
    """Chunks of different lengths at different starts (uncached rests of prompts) run as groups padded to their
    longest, each with no more padding than real tokens. Every row's greedy
    token is that of its full prompt alone, and the decode step after finds every cache intact: padding wrote
    into no sequence's blocks."""
    model, runner, seen = _runner()
    params = Params(Sampling(8, 0.0))
    prompts = [[5, 9, 2, 7, 1, 3, 8], [4, 4, 8, 1, 2, 6, 9, 9, 3, 1], [7, 7, 1, 5, 2, 2, 6], [3, 1, 4, 1, 5],
               list(range(1, 21))]
    tables = [[0, 1], [2, 3, 4], [5, 6], [7, 8], [9, 10, 11, 12, 13, 14]]
    heads = [4, 5, 4, 0, 0]  # positions already cached: rows 0-2 feed their last 3-5 tokens, rows 3-4 whole prompts
    cached = [Row(i, p[:h], 0, tables[i], False) for i, (p, h) in enumerate(zip(prompts, heads, strict=True)) if h]
    runner.execute(Step(new=[(i, params) for i in range(5)], rows=cached))
    seen.clear()
    builds = runner.batch.builds
    out = runner.execute(Step(rows=[Row(i, p[h:], h, tables[i], True)
                                    for i, (p, h) in enumerate(zip(prompts, heads, strict=True))]))
    # longest first: 20 + 5 + 5 tokens padded to 3 x 20 (no more padding than real tokens), then the two of 3
    assert runner.batch.builds - builds == 2 and len(seen) == 2 * LAYERS, "two forwards for five chunks"
    padded, plain = seen[0]["pos"].tolist(), seen[LAYERS]["pos"].tolist()
    assert padded == [list(range(20)), [5, 6, 7, 8, 9] + [9] * 15, [0, 1, 2, 3, 4] + [4] * 15]
    assert plain == [[4, 5, 6], [4, 5, 6]]
    tokens = [[*p, o[0]] for p, o in zip(prompts, out, strict=True)]
    for t in tokens:
        assert t[-1] == int(model(torch.tensor([t[:-1]]))[0, -1].argmax())
    out = runner.execute(Step(rows=[Row(i, t[-1:], len(t) - 1, tables[i], True) for i, t in enumerate(tokens)]))
    for t, o in zip(tokens, out, strict=True):
        assert o[0] == int(model(torch.tensor([t]))[0, -1].argmax())


def test_a_forwards_mask_is_made_once_in_the_scores_dtype_not_converted_by_every_layer():
    """The decode step's mask reaches attention as an additive float mask built once for the forward; a boolean
    one would be turned into -inf and 0 by SDPA in every layer (more operations a layer, each a kernel on a GPU)."""
    model, runner, seen = _runner()
    params = Params(Sampling(8, 0.0))
    prompts = [[5, 9, 2, 7, 1, 3], [4, 4, 8, 1]]
    first = runner.execute(Step(new=[(0, params), (1, params)],
                                rows=[Row(i, p, 0, [2 * i, 2 * i + 1], True) for i, p in enumerate(prompts)]))
    seen.clear()
    with Ops() as ops:
        out = runner.execute(Step(rows=[Row(i, [o[0]], len(p), [2 * i, 2 * i + 1], True)
                                        for i, (p, o) in enumerate(zip(prompts, first, strict=True))]))
    masks = [e["mask"] for e in seen]
    assert masks[0].dtype == torch.float32 and all(m is masks[0] for m in masks)
    assert ops.count["where"] == 0 and ops.count["masked_fill"] == 1, dict(ops.count)
    # every row samples at the forward's last position: its logits are a slice, not a gather by index tensors made
    # on the host (each a copy to a GPU); the one indexing left is the view's slots of the keys
    assert ops.count["index"] == 1, dict(ops.count)
    for p, f, o in zip(prompts, first, out, strict=True):  # the same greedy tokens as a full forward
        assert o[0] == int(model(torch.tensor([[*p, f[0]]]))[0, -1].argmax())


def test_rounded_key_lengths_come_back_for_later_steps_and_give_the_same_tokens():
    """With ``round_keys`` (a GPU's setting: its attention may prepare a plan per shape) a decoding step reads keys
    up to a rounded length, so the next steps meet the same shape instead of one more key each; the extra keys are
    masked: every greedy token is the full forward's. A CPU reads the exact length (its outputs' bits unchanged)."""
    model, runner, seen = _runner()
    assert not runner.batch.round_keys, "a CPU reads exactly the keys there are"
    runner.batch.round_keys = True
    params = Params(Sampling(32, 0.0))
    prompts, tables = [[5, 9, 2, 7, 1, 3], [4, 4, 8]], [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]
    out = runner.execute(Step(new=[(0, params), (1, params)],
                              rows=[Row(i, p, 0, tables[i], True) for i, p in enumerate(prompts)]))
    tokens = [[*p, o[0]] for p, o in zip(prompts, out, strict=True)]
    lengths = []
    for _ in range(24):
        seen.clear()
        out = runner.execute(Step(rows=[Row(i, t[-1:], len(t) - 1, tables[i], True) for i, t in enumerate(tokens)]))
        end = max(len(t) for t in tokens)
        length = seen[0]["mask"].shape[-1]
        assert length % 4 == 0 and end <= length < end + 4, (end, length)  # whole blocks of 4, none more
        lengths.append(length)
        for t, o in zip(tokens, out, strict=True):
            t.append(o[0])
    assert len(set(lengths)) <= 24 // 4 + 1, f"a new key length every step: {lengths}"
    for t in tokens:  # each token is the full forward's greedy one
        assert t[-1] == int(model(torch.tensor([t[:-1]]))[0, -1].argmax())
        assert t[-12] == int(model(torch.tensor([t[:-12]]))[0, -1].argmax())


def test_a_key_length_is_rounded_to_whole_blocks_and_an_eighth_of_its_power_of_two():
    from plait.serve.kv import PagedBatch

    batch = PagedBatch(16, torch.device("cpu"), 8)
    assert [batch.key_length(n) for n in (1, 69, 4097)] == [1, 69, 4097]  # a CPU: exact
    batch.round_keys = True
    rounded = [batch.key_length(n) for n in range(1, 8193)]
    for n, length in enumerate(rounded, start=1):
        assert length % 16 == 0 and n <= length <= max(n + 15, n * 9 // 8), (n, length)
    assert rounded == sorted(rounded) and rounded[68] == 80 and rounded[130] == 144
    assert len(set(rounded)) <= 16 + 8 * 9, "a few lengths per doubling, not one per position"



def _join_and_leave(round_keys: bool) -> tuple[Llama, Runner, list[list[int]], list[int], list[list[int]]]:
    """Five sequences decoded in steps whose rows come and go: (model, runner, prompts, rows per step, tokens)."""
    model, runner, seen = _runner()
    runner.batch.round_keys = round_keys
    params = Params(Sampling(32, 0.0))
    prompts = [[5, 9, 2], [4, 4, 8, 1], [7, 3], [6, 1, 2, 9, 3], [2, 8, 5]]
    tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(len(prompts))]
    out = runner.execute(Step(new=[(i, params) for i in range(len(prompts))],
                              rows=[Row(i, p, 0, tables[i], True) for i, p in enumerate(prompts)]))
    tokens = [[*p, o[0]] for p, o in zip(prompts, out, strict=True)]
    counts = []
    for live in ([0, 1], [0, 1, 2], [0, 1, 2, 3, 4], [1, 2, 3, 4], [2, 4], [4], [2, 3, 4]):  # joining, leaving
        seen.clear()
        out = runner.execute(Step(rows=[Row(i, tokens[i][-1:], len(tokens[i]) - 1, tables[i], True) for i in live]))
        assert len(out) == len(live)
        counts.append(seen[0]["pos"].shape[0])
        for i, o in zip(live, out, strict=True):
            tokens[i].append(o[0])
    return model, runner, prompts, counts, tokens


def test_rounded_row_counts_come_back_as_sequences_join_and_leave_and_give_the_same_tokens():
    """With ``round_keys`` a forward of one-token rows runs a rounded number of rows (padding rows that write only
    to the spare block, their outputs dropped), so a batch whose sequences come and go meets the same row count
    again instead of a new shape per count; every greedy token is still the full forward's, and the sequences'
    blocks hold what the exact rows write. A CPU runs exactly the rows there are."""
    _, exact, _, counts, exact_tokens = _join_and_leave(round_keys=False)
    assert counts == [2, 3, 5, 4, 2, 1, 3]
    model, runner, prompts, counts, tokens = _join_and_leave(round_keys=True)
    assert counts == [8] * 7, f"a new row count as the batch changed: {counts}"
    assert tokens == exact_tokens
    for p, t in zip(prompts, tokens, strict=True):  # each generated token is the full forward's greedy one
        for n in range(len(p), len(t)):
            assert t[n] == int(model(torch.tensor([t[:n]]))[0, -1].argmax()), (t, n)
    pool = 16 * 4  # the sequences' slots; the spare block follows
    for name, cache in runner.caches.items():
        torch.testing.assert_close(cache.k[:pool], exact.caches[name].k[:pool], msg=name)
        torch.testing.assert_close(cache.v[:pool], exact.caches[name].v[:pool], msg=name)
