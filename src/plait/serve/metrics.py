"""Serving counters and gauges, rendered in the Prometheus text format for ``GET /metrics``."""

from __future__ import annotations

import threading
import time
from collections import deque

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """Thread-safe: the HTTP thread counts requests, the engine loop counts tokens and batch sizes."""

    def __init__(self, window_s: float = 10.0):
        self.lock = threading.Lock()
        self.window_s = window_s
        # status -> count: ok, cancelled (by the client), rejected (queue full), timeout, shutdown (ended by a
        # stop before they finished), error (ended by an engine failure)
        self.requests: dict[str, int] = {}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps, for tokens/s
        self.queue_depth = 0
        self.batch_size = 0
        self.kv_used = 0
        self.kv_budget = 0
        self.steps = 0
        self.prefill_chunks = 0
        self.preemptions = 0
        self.cached_tokens = 0
        self.window_freed = 0
        self.ttft = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self.ttft_count = 0

    def request(self, status: str, n: int = 1) -> None:
        with self.lock:
            self.requests[status] = self.requests.get(status, 0) + n

    def step(self, tokens: int, batch: int, queue: int, kv_used: int, prompt_tokens: int, chunks: int = 0,
             preemptions: int = 0, cached_tokens: int = 0, window_freed: int = 0) -> None:
        now = time.monotonic()
        with self.lock:
            self.steps += 1
            self.prefill_chunks += chunks
            self.preemptions = preemptions
            self.cached_tokens = cached_tokens
            self.window_freed = window_freed
            self.generated_tokens += tokens
            self.prompt_tokens += prompt_tokens
            self.batch_size, self.queue_depth, self.kv_used = batch, queue, kv_used
            self.recent.append((now, tokens))
            while self.recent and self.recent[0][0] < now - self.window_s:
                self.recent.popleft()

    def first_token(self, seconds: float) -> None:
        with self.lock:
            self.ttft_sum += seconds
            self.ttft_count += 1
            i = next((i for i, b in enumerate(TTFT_BUCKETS) if seconds <= b), len(TTFT_BUCKETS))
            self.ttft[i] += 1

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        with self.lock:
            n = sum(t for when, t in self.recent if when >= now - self.window_s)
        return n / self.window_s

    def render(self) -> str:
        tps = self.tokens_per_s()
        with self.lock:
            lines = ["# HELP plait_requests_total Requests by outcome.", "# TYPE plait_requests_total counter"]
            for status in sorted(set(self.requests) | {"ok", "cancelled", "rejected", "timeout", "shutdown", "error"}):
                lines.append(f'plait_requests_total{{status="{status}"}} {self.requests.get(status, 0)}')
            lines += [
                "# TYPE plait_prompt_tokens_total counter", f"plait_prompt_tokens_total {self.prompt_tokens}",
                "# TYPE plait_generated_tokens_total counter", f"plait_generated_tokens_total {self.generated_tokens}",
                "# HELP plait_tokens_per_second Generated tokens per second over the last window.",
                "# TYPE plait_tokens_per_second gauge", f"plait_tokens_per_second {tps:.3f}",
                "# TYPE plait_queue_depth gauge", f"plait_queue_depth {self.queue_depth}",
                "# TYPE plait_batch_size gauge", f"plait_batch_size {self.batch_size}",
                "# TYPE plait_kv_tokens_used gauge", f"plait_kv_tokens_used {self.kv_used}",
                "# TYPE plait_kv_tokens_budget gauge", f"plait_kv_tokens_budget {self.kv_budget}",
                "# TYPE plait_engine_steps_total counter", f"plait_engine_steps_total {self.steps}",
                "# HELP plait_prefill_chunks_total Prompt chunks prefilled (a prompt may take several steps).",
                "# TYPE plait_prefill_chunks_total counter", f"plait_prefill_chunks_total {self.prefill_chunks}",
                "# HELP plait_preemptions_total Sequences preempted for want of KV blocks (recomputed later).",
                "# TYPE plait_preemptions_total counter", f"plait_preemptions_total {self.preemptions}",
                "# HELP plait_prefix_cache_tokens_total Prompt tokens taken from cached KV blocks, not prefilled.",
                "# TYPE plait_prefix_cache_tokens_total counter",
                f"plait_prefix_cache_tokens_total {self.cached_tokens}",
                "# HELP plait_kv_window_freed_blocks_total KV blocks freed while their sequence ran: no layer's "
                "sliding window reaches them any more.",
                "# TYPE plait_kv_window_freed_blocks_total counter",
                f"plait_kv_window_freed_blocks_total {self.window_freed}",
                "# HELP plait_time_to_first_token_seconds From arrival to the first generated token.",
                "# TYPE plait_time_to_first_token_seconds histogram",
            ]
            cumulative = 0
            for b, n in zip(TTFT_BUCKETS, self.ttft, strict=False):
                cumulative += n
                lines.append(f'plait_time_to_first_token_seconds_bucket{{le="{b}"}} {cumulative}')
            lines.append(f'plait_time_to_first_token_seconds_bucket{{le="+Inf"}} {self.ttft_count}')
            lines.append(f"plait_time_to_first_token_seconds_sum {self.ttft_sum:.6f}")
            lines.append(f"plait_time_to_first_token_seconds_count {self.ttft_count}")
        return "\n".join(lines) + "\n"
