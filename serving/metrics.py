"""The server's Prometheus metrics, named as vLLM names them with ``pagedllm:`` for ``vllm:``.

A dashboard built for vLLM reads these once its queries say ``pagedllm:`` where they said
``vllm:``. Every metric carries vLLM's ``model_name`` label and vLLM V1's ``engine`` label:
"0", or each data-parallel replica's index (``--data-parallel-size``); sum over it for the
server's total.

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
- ``pagedllm:spec_decode_num_drafts`` / ``pagedllm:spec_decode_num_draft_tokens`` /
  ``pagedllm:spec_decode_num_accepted_tokens`` / ``pagedllm:spec_decode_num_accepted_tokens_per_pos
  {position}``: speculative decoding's verification runs, tokens proposed and accepted (vLLM's
  ``vllm:spec_decode_*``; acceptance rate = accepted / draft tokens).

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


# name -> (kind, help, buckets or extra label): the families, made once per registry.
FAMILIES = {
    "num_requests_running": ("gauge", "Requests in the running queue.", None),
    "num_requests_waiting": ("gauge", "Requests waiting to be admitted.", None),
    "num_requests_swapped": ("gauge", "Requests swapped out to CPU memory.", None),
    "kv_cache_usage_perc": ("gauge", "KV-cache blocks in use, 0 to 1.", None),
    "gpu_cache_usage_perc": ("gauge", "KV-cache blocks in use, 0 to 1 (vLLM V0's name for "
                             "kv_cache_usage_perc).", None),
    "gpu_prefix_cache_hit_rate": ("gauge", "Prompt tokens found in the prefix cache / prompt "
                                  "tokens looked up.", None),
    "kv_cache_bytes_per_token": ("gauge", "KV-cache bytes per token, as --kv-cache-dtype "
                                 "stores it (scales included).", None),
    "kv_cache_capacity_tokens": ("gauge", "Tokens the KV pool holds.", None),
    "num_preemptions": ("counter", "Preemptions, by mode.", "mode"),
    "prompt_tokens": ("counter", "Prompt tokens prefilled.", None),
    "generation_tokens": ("counter", "Tokens generated.", None),
    "prefix_cache_queries": ("counter", "Prompt tokens looked up in the prefix cache.", None),
    "prefix_cache_hits": ("counter", "Prompt tokens found in the prefix cache.", None),
    # speculative decoding (vLLM's vllm:spec_decode_* names); zero without speculation
    "spec_decode_num_drafts": ("counter", "Verification runs: a sequence's proposals checked "
                               "in one step.", None),
    "spec_decode_num_draft_tokens": ("counter", "Tokens proposed.", None),
    "spec_decode_num_accepted_tokens": ("counter", "Proposed tokens accepted.", None),
    "spec_decode_num_accepted_tokens_per_pos": ("counter", "Proposed tokens accepted, by "
                                                "position in the run.", "position"),
    "request_success": ("counter", "Requests finished, by finish reason.", "finished_reason"),
    "time_to_first_token_seconds": ("histogram", "Arrival to first token.", TTFT_BUCKETS),
    "time_per_output_token_seconds": ("histogram", "Time between a request's token-producing "
                                      "steps.", TPOT_BUCKETS),
    "e2e_request_latency_seconds": ("histogram", "Arrival to last token.", E2E_BUCKETS),
    "request_prompt_tokens": ("histogram", "Prompt length.", TOKEN_BUCKETS),
    "request_generation_tokens": ("histogram", "Tokens generated per request.", TOKEN_BUCKETS),
}
LABELS = ["model_name", "engine"]


def _families(registry: CollectorRegistry) -> dict:
    made = {}
    for name, (kind, doc, extra) in FAMILIES.items():
        if kind == "gauge":
            made[name] = Gauge(PREFIX + name, doc, LABELS, registry=registry)
        elif kind == "counter":
            made[name] = Counter(PREFIX + name, doc, LABELS + ([extra] if extra else []),
                                 registry=registry)
        else:
            made[name] = Histogram(PREFIX + name, doc, LABELS, buckets=extra,
                                   registry=registry)
    return made


class ServerMetrics:
    """One engine's metrics. One registry per server (tests run several servers in one
    process); a data-parallel server's engines share it, each with its ``engine`` label (0, 1,
    ...: vLLM V1 labels its engines so): ``for_engine(i)`` gives engine i's, and a total is the
    sum over the label."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 engine: int = 0, families: dict | None = None):
        self.model_name, self.engine = model_name, engine
        self.registry = registry or CollectorRegistry()
        self.families = families or _families(self.registry)
        ids = (model_name, str(engine))

        def child(name):
            return self.families[name].labels(*ids)

        self.running = child("num_requests_running")
        self.waiting = child("num_requests_waiting")
        self.swapped = child("num_requests_swapped")
        self.kv_usage = child("kv_cache_usage_perc")
        self.gpu_usage = child("gpu_cache_usage_perc")
        self.prefix_hit_rate = child("gpu_prefix_cache_hit_rate")
        self.kv_bytes_per_token = child("kv_cache_bytes_per_token")
        self.kv_capacity = child("kv_cache_capacity_tokens")
        self.preemptions = {mode: self.families["num_preemptions"].labels(*ids, mode)
                            for mode in ("recompute", "swap")}
        self.prompt_tokens = child("prompt_tokens")
        self.generation_tokens = child("generation_tokens")
        self.prefix_queries = child("prefix_cache_queries")
        self.prefix_hits = child("prefix_cache_hits")
        self.finished = {reason: self.families["request_success"].labels(*ids, reason)
                         for reason in ("stop", "length", "abort", "error")}
        self.ttft = child("time_to_first_token_seconds")
        self.tpot = child("time_per_output_token_seconds")
        self.e2e = child("e2e_request_latency_seconds")
        self.request_prompt_tokens = child("request_prompt_tokens")
        self.request_generation_tokens = child("request_generation_tokens")
        self._last = {"preemptions_recompute": 0, "preemptions_swap": 0,
                      "prefix_cache_hit_tokens": 0, "prefill_tokens": 0}
        self._queried = self._hit = 0
        self.spec = {name: child(name) for name in ("spec_decode_num_drafts",
                                                    "spec_decode_num_draft_tokens",
                                                    "spec_decode_num_accepted_tokens")}
        self.spec_per_pos: list = []  # by position, made as positions appear
        self._ids = ids

    def for_engine(self, engine: int) -> "ServerMetrics":
        """Engine ``engine``'s metrics, in this registry."""
        return ServerMetrics(self.model_name, self.registry, engine, self.families)

    def _update_spec_decode(self, stats: dict) -> None:
        """Speculative decoding's counters, moved by what changed (absent: no speculation)."""
        for name, counter in self.spec.items():
            if name in stats:
                counter.inc(stats[name] - self._last.get(name, 0))
                self._last[name] = stats[name]
        per_pos = stats.get("spec_decode_num_accepted_tokens_per_pos", [])
        family = self.families["spec_decode_num_accepted_tokens_per_pos"]
        while len(self.spec_per_pos) < len(per_pos):
            self.spec_per_pos.append(family.labels(*self._ids, str(len(self.spec_per_pos))))
        for j, value in enumerate(per_pos):
            key = f"spec_decode_per_pos_{j}"
            self.spec_per_pos[j].inc(value - self._last.get(key, 0))
            self._last[key] = value

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
        self._update_spec_decode(stats)
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
