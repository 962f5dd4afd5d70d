"""Plain-language reasons why the best layout of a search beats the others."""

from __future__ import annotations

from plait.plan.attention import window_share
from plait.plan.estimate import PARTS, Estimate
from plait.plan.model import Model
from plait.plan.search import CP_MIN_SEQ_LEN, SearchResult
from plait.words import counted

GB = 1e9
#: the longest sequence whose plan does not say that context parallelism was left out of its search
LONG = 8192


def memory_unit(estimates: list[Estimate]) -> tuple[str, float]:
    """The unit the memory of ``estimates`` is said in: GB, or MiB where the most loaded device needs under a GB
    (plait's own small runs, in the unit plait train says its ranks' memory in)."""
    return ("MiB", 2.0**20) if max(e.memory.total for e in estimates) < GB else ("GB", GB)


def _shape(e: Estimate) -> tuple[int, int, int, int]:
    return e.layout.tp, e.layout.pp, e.layout.dp, e.layout.cp


def _versus(best: Estimate, other: Estimate) -> str:
    """One sentence: how much faster ``best`` is than ``other`` and which time buckets explain it."""
    gain = other.step_time_s / best.step_time_s - 1
    diffs = sorted(((other.time[k] - best.time[k], k) for k in best.time), reverse=True)
    parts = [f"{PARTS[k]} {other.time[k]:.2f}→{best.time[k]:.2f} s" for d, k in diffs[:2] if d > 1e-3]
    because = f" ({'; '.join(parts)})" if parts else ""
    return f"{gain:+.1%} faster than {other.layout.short()}{because}"


def explain(result: SearchResult) -> list[str]:
    """Why ``result.best[0]`` wins: against the runner-up, the best of another tp/pp/dp shape (when that is
    not the runner-up), and what the rejected layouts lacked."""
    if not result.best:
        return [nothing_fits(result)]
    best = result.best[0]
    unit, scale = memory_unit(result.best)
    lines = [f"best: {best.layout.short()} — {best.step_time_s:.2f} s/step, MFU {best.mfu:.1%}, "
             f"{best.memory.total / scale:,.1f} of {best.memory.usable / scale:,.1f} {unit}"]
    if len(result.best) > 1:
        lines.append("vs runner-up: " + _versus(best, result.best[1]))
    other = next((e for e in result.best[1:] if _shape(e) != _shape(best)), None)
    if other is not None and other is not result.best[1]:  # the runner-up was already set beside it
        lines.append("vs another shape: " + _versus(best, other))
    t = best.time
    worst = max((k for k in t if k != "compute"), key=lambda k: t[k])
    bubble = f"bubble {best.bubble_fraction:.1%} with {counted(best.microbatches, 'micro-batch')}"
    if t[worst] >= 0.01 * best.step_time_s:
        lines.append(f"its largest overhead is {PARTS[worst]}: {t[worst]:.2f} s "
                     f"({t[worst] / best.step_time_s:.0%} of the step); {bubble}")
    else:  # nothing to name: every part but the compute under 1% of the step
        lines.append(f"no overhead reaches 1% of the step: compute is {t['compute'] / best.step_time_s:.0%} of it; "
                     f"{bubble}")
    if result.rejected:
        top = ", ".join(f"{k}: {v:,}" for k, v in result.rejected.most_common(4))
        lines.append(f"rejected {sum(result.rejected.values()):,} of {counted(result.considered, 'layout')} ({top}); "
                     f"{counted(result.pruned, 'valid one')} pruned as slower")
    if result.twins:
        lines.append(_twins(result))
    window = window_line(best)
    if window:
        lines.append(window)
    if LONG < best.model.seq_len and not result.cp_searched:
        lines.append(f"context parallelism was not searched: the search splits sequences of {CP_MIN_SEQ_LEN:,} tokens "
                     f"or more, these are {best.model.seq_len:,} (plait.plan.estimate costs a layout with cp > 1)")
    return lines


def window_line(best: Estimate) -> str:
    """One line on the model's sliding window where it hides keys at this sequence length (else ""): on which
    layers, and how the cluster's cost model counts their attention."""
    m = best.model
    if not m.window_layer_share:
        return ""
    assert m.sliding_window is not None  # window_layer_share is 0 without one
    layers = m.n_layers if m.window_layers is None else m.window_layers
    head = f"sliding window of {m.sliding_window:,} keys on {layers} of {m.n_layers} layers at {m.seq_len:,} tokens"
    if best.cluster.profile is not None:
        return (f"{head}: the calibrated host's model times their attention as causal over the whole sequence "
                "(what the window saves under cp > 1 is not counted); their memory counts the window's mask")
    return (f"{head}: at cp 1 SDPA computes their whole square behind the window's mask (twice a causal "
            "layer's attention) and keeps the mask; under cp > 1 plait's blockwise attention computes only the pairs "
            f"the window keeps ({window_share(m.seq_len, m.sliding_window):.0%} of the causal ones), so context "
            "parallelism is searched at any length; the MFU counts the window's keys")


# what each setting of ``search.TWIN_SETTINGS`` tells apart, and why that changes nothing
_TWIN_WORDS = {"zero": ("ZeRO-1/ZeRO-2", "plait's ZeRO-2 reduces once per step, as ZeRO-1"),
               "recompute": ("selective/no recomputation",
                             "fused attention already recomputes what selective recomputation would")}


def _twins(result: SearchResult) -> str:
    """One line: how many layouts were left out for an equally fast twin, by the settings told apart."""
    counts = ", ".join(f"{n} {' and '.join(_TWIN_WORDS[k][0] for k in kinds.split('+'))}"
                       for kinds, n in result.twin_settings.most_common())
    why = "; ".join(_TWIN_WORDS[k][1] for k in _TWIN_WORDS if any(k in kinds for kinds in result.twin_settings))
    return (f"{counted(result.twins, 'layout')} as fast as a twin that differs only in settings that change nothing "
            f"here ({counts}): only the one with less memory, else the simpler, is ranked ({why})")


def min_gpus_hint(model: Model, usable_per_gpu: float) -> int:
    """GPUs needed just for the bf16 weights, fp32 grads and Adam states, spread perfectly."""
    return int(-(-18 * model.n_params() // usable_per_gpu))


def nothing_fits(result: SearchResult, model: Model | None = None, usable_per_gpu: float = 0.0,
                 n_gpus: int | None = None) -> str:
    """One line: why no layout fits and what would. The need quoted is the least any valid layout needs, each
    counted in full or by a bound above the memory there is (so always above it); with the model and the GPUs,
    whether the model states alone outgrow ``n_gpus`` GPUs or the activations are what does not fit."""
    if result.smallest_memory == float("inf") or not result.smallest_memory:
        keys = ", ".join(f"{k} ({v})" for k, v in result.rejected.most_common(3))
        return f"no valid layout: every one breaks a rule: {keys}"
    msg = f"no layout fits: the leanest needs {result.smallest_memory / GB:.1f} GB per GPU"
    if model is None or not usable_per_gpu:
        return msg
    need = min_gpus_hint(model, usable_per_gpu)
    if n_gpus is None or need > n_gpus:
        return msg + (f" of {usable_per_gpu / GB:.1f} usable; model states alone need ≥ {need} such GPUs (use at "
                      f"least {need}, or a larger GPU)")
    return msg + (f" of {usable_per_gpu / GB:.1f} usable; the model states fit ({need} such GPUs hold them), the "
                  f"activations of {model.seq_len:,}-token sequences do not: a shorter sequence, more GPUs to split "
                  "them over, or a larger GPU")
