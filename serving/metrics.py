"""The server's Prometheus metrics, named as vLLM names them with ``pagedllm:`` for ``vllm:``.

A dashboard built for vLLM reads these once its queries say ``pagedllm:`` where they said
``vllm:``. Every metric carries vLLM's ``model_name`` label.

Gauges, set after every engine step from ``LLMEngine.stats()``:

- ``pagedllm:num_requests_running`` / ``_waiting`` / ``_swapped``: the scheduler's three queues;
- ``pagedllm:kv_cache_usage_perc`` (vLLM V1's name) and ``pagedllm:gpu_cache_usage_perc``
  (V0's name, the same value): the share of KV blocks in use, 0 to 1 (the block usage ratio);
- ``pagedllm:gpu_prefix_cache_hit_rate``: prompt tokens found in the prefix cache / tokens
  looked up, since the server started (0 unless ``--enable-prefix-caching``);
- ``pagedllm:kv_cache_bytes_per_token`` / ``pagedllm:kv_cache_capacity_tokens`` (pagedllm's
  own): what one token costs in the pool as ``--kv-cache-dtype`` stores it, scales included, and
  how many tokens the pool holds.

Counters (exposed with ``_total``):

- ``pagedllm:num_preemptions{mode="recompute"|"swap"}``: requests preempted, by how;
- ``pagedllm:prompt_tokens`` / ``pagedllm:generation_tokens``: tokens of prompts prefilled and
  tokens generated;
- ``pagedllm:prefix_cache_queries`` / ``pagedllm:prefix_cache_hits``: tokens looked up in the
  prefix cache at prefill (found there + computed) and found there (vLLM V1's pair; their
  ratio is the hit rate);
- ``pagedllm:request_success{finished_reason="stop"|"length"|"abort"|"error"}``: requests ended.

Histograms (seconds unless said):

- ``pagedllm:time_to_first_token_seconds``: arrival to first generated token, queueing included;
- ``pagedllm:time_per_output_token_seconds``: time between a request's successive steps that
  produced tokens;
- ``pagedllm:e2e_request_latency_seconds``: arrival to last token;
- ``pagedllm:request_prompt_tokens`` / ``pagedllm:request_generation_tokens``: lengths (tokens).
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "pagedllm:"

# vLLM's buckets, so that the histograms line up with a vLLM dashboard's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class ServerMetrics:
    """One registry per server (tests run several servers in one process)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = reg = registry or CollectorRegistry()
        label = ["model_name"]

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, label, registry=reg).labels(model_name)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, label, registry=reg).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, label, buckets=buckets,
                             registry=reg).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running queue.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be admitted.")
        self.swapped = gauge("num_requests_swapped", "Requests swapped out to CPU memory.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache blocks in use, 0 to 1.")
        self.gpu_usage = gauge("gpu_cache_usage_perc", "KV-cache blocks in use, 0 to 1 (vLLM "
                               "V0's name for kv_cache_usage_perc).")
        self.prefix_hit_rate = gauge("gpu_prefix_cache_hit_rate", "Prompt tokens found in the "
                                     "prefix cache / prompt tokens looked up.")
        self.kv_bytes_per_token = gauge("kv_cache_bytes_per_token", "KV-cache bytes per token, "
                                        "as --kv-cache-dtype stores it (scales included).")
        self.kv_capacity = gauge("kv_cache_capacity_tokens", "Tokens the KV pool holds.")
        preemptions = Counter(PREFIX + "num_preemptions", "Preemptions, by mode.",
                              [*label, "mode"], registry=reg)
        self.preemptions = {mode: preemptions.labels(model_name, mode)
                            for mode in ("recompute", "swap")}
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the "
                                      "prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        success = Counter(PREFIX + "request_success", "Requests finished, by finish reason.",
                          [*label, "finished_reason"], registry=reg)
        self.finished = {reason: success.labels(model_name, reason)
                         for reason in ("stop", "length", "abort", "error")}
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.",
                              TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Time between a request's "
                              "token-producing steps.", TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.",
                             E2E_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt length.",
                                               TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Tokens generated per request.", TOKEN_BUCKETS)
        self._last = {"preemptions_recompute": 0, "preemptions_swap": 0,
                      "prefix_cache_hit_tokens": 0, "prefill_tokens": 0}
        self._queried = self._hit = 0

    def update_from_stats(self, stats: dict) -> None:
        """Gauges take the engine's numbers; counters move by what changed since last time."""
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.swapped.set(stats["swapped"])
        self.kv_usage.set(stats["usage"])
        self.gpu_usage.set(stats["usage"])
        self.kv_bytes_per_token.set(stats["kv_bytes_per_token"])
        self.kv_capacity.set(stats["kv_capacity_tokens"])
        for mode in ("recompute", "swap"):
            key = f"preemptions_{mode}"
            self.preemptions[mode].inc(stats[key] - self._last[key])
            self._last[key] = stats[key]
        if "prefix_cache_hit_tokens" in stats:
            # Every token a prefill needs is either found in the cache (a hit) or computed (a
            # prefill token): queries = hits + prefill tokens. Recomputing a preempted request
            # queries again, and usually hits: its own blocks are still cached.
            hits = stats["prefix_cache_hit_tokens"] - self._last["prefix_cache_hit_tokens"]
            computed = stats["prefill_tokens"] - self._last.get("prefill_tokens", 0)
            self._last["prefix_cache_hit_tokens"] = stats["prefix_cache_hit_tokens"]
            self._last["prefill_tokens"] = stats["prefill_tokens"]
            self.prefix_hits.inc(hits)
            self.prefix_queries.inc(hits + computed)
            self._hit += hits
            self._queried += hits + computed
            if self._queried:
                self.prefix_hit_rate.set(self._hit / self._queried)
