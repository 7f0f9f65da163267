"""Prometheus metrics: vLLM names present from the start, latencies from engine hooks, wire bytes by codec."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from cloud_server.metrics import ServerMetrics


def _samples(m: ServerMetrics) -> dict:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_series_exist_before_the_first_request_and_count_afterwards():
    m = ServerMetrics("glm")
    s = _samples(m)
    lab = (("model_name", "glm"),)
    assert s[("vllm:num_requests_running", lab)] == 0 and s[("vllm:kv_cache_usage_perc", lab)] == 0
    seq = SimpleNamespace(num_prompt_tokens=20, num_cached_tokens=16, prefix_keys=["k"], variant="fp32",
                          arrival_time=100.0, last_token_time=None, finish_reason="stop")
    m.on_admit(seq)
    m.on_token(seq, 100.5)  # first token: TTFT 0.5 s
    seq.last_token_time = 100.5
    m.on_token(seq, 100.6)  # then ITL 0.1 s
    m.on_uplink(2048, "fp16", 16)
    m.on_downlink(40)
    s = _samples(m)
    assert s[("vllm:time_to_first_token_seconds_sum", lab)] == 0.5
    assert abs(s[("vllm:inter_token_latency_seconds_sum", lab)] - 0.1) < 1e-9
    assert s[("vllm:prefix_cache_hits_total", lab)] == 16 and s[("vllm:prefix_cache_queries_total", lab)] == 20
    assert s[("vllm:generation_tokens_total", lab)] == 2
    codec = (("codec", "fp16"), ("model_name", "glm"))
    assert s[("autoglm:uplink_bytes_total", codec)] == 2048
    assert s[("autoglm:uplink_bytes_per_token_sum", codec)] == 128
    assert s[("autoglm:downlink_bytes_total", lab)] == 40
