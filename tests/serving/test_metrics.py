"""/metrics: Prometheus text that prometheus-client's own parser reads, vLLM's names under
`pagedllm:`, counters that move as requests run."""

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .conftest import MODEL, wait_until_idle

VLLM_NAMES = [  # vLLM's names, with the prefix changed
    "num_requests_running", "num_requests_waiting", "num_requests_swapped",
    "kv_cache_usage_perc", "gpu_cache_usage_perc", "gpu_prefix_cache_hit_rate",
    "num_preemptions", "prompt_tokens", "generation_tokens", "prefix_cache_queries",
    "prefix_cache_hits", "request_success", "time_to_first_token_seconds",
    "time_per_output_token_seconds", "e2e_request_latency_seconds", "request_prompt_tokens",
    "request_generation_tokens"]


def scrape(url: str) -> dict:
    """{(sample name, sorted labels minus model_name and engine): value}, and every family's
    name. One engine: every sample's engine label is "0" (vLLM V1's label; a data-parallel
    server numbers its replicas)."""
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        assert family.name.startswith("pagedllm:"), family.name
        samples.setdefault("families", set()).add(family.name.removeprefix("pagedllm:"))
        for s in family.samples:
            assert s.labels.pop("model_name") == MODEL
            assert s.labels.pop("engine") == "0"
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples[("pagedllm:" + name, tuple(sorted(labels.items())))]


def test_metrics_parse_and_move(server, client):
    before = scrape(server.url)
    assert set(VLLM_NAMES) <= before["families"]
    client.completions.create(model=MODEL, prompt="The for statement is used to",
                              max_tokens=6, extra_body={"ignore_eos": True}, n=2)
    client.completions.create(model=MODEL, prompt="Return a", max_tokens=1)
    wait_until_idle(server)
    after = scrape(server.url)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("generation_tokens_total") == 2 * 6 + 1
    assert moved("prompt_tokens_total") > 0
    assert moved("request_success_total", finished_reason="length") == 2
    assert moved("time_to_first_token_seconds_count") == 2
    assert moved("e2e_request_latency_seconds_count") == 2
    assert moved("time_per_output_token_seconds_count") == 5  # the first request's 5 gaps
    assert moved("request_generation_tokens_sum") == 13
    assert value(after, "num_requests_running") == 0
    assert value(after, "kv_cache_usage_perc") == 0.0
    bucket = ("pagedllm:time_to_first_token_seconds_bucket", (("le", "+Inf"),))
    assert after[bucket] == value(after, "time_to_first_token_seconds_count")
