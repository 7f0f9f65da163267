"""Prometheus metrics: vLLM names present from the start, latencies from engine hooks, wire bytes by codec."""

from __future__ import annotations

import time
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
    assert s[("autoglm:edge_round_trip_seconds_count", lab)] == 0
    assert s[("autoglm:engine_step_seconds_count", lab)] == 0 and s[("autoglm:engine_input_wait_seconds_sum", lab)] == 0
    assert s[("autoglm:engine_device_step_seconds_count", lab)] == 0
    passes = {b: (("batch", b),) + lab for b in ("persistent", "rebuilt")}
    assert s[("autoglm:engine_forward_passes_total", passes["persistent"])] == 0
    # the refusals an alert rates: at 0 before the first (a rate of a series that is absent needed `or vector(0)`)
    for status, reason in (("429", "overloaded"), ("503", "draining")):
        assert s[("autoglm:http_requests_refused_total", lab + (("reason", reason), ("status", status)))] == 0
    for reason in ("overloaded", "key_session_cap", "max_connections", "draining"):
        assert s[("autoglm:sessions_refused_total", lab + (("reason", reason),))] == 0
    seq = SimpleNamespace(num_prompt_tokens=20, num_cached_tokens=16, prefix_keys=["k"], variant="fp32",
                          arrival_time=100.0, last_token_time=None, finish_reason="stop")
    m.on_admit(seq)
    m.on_token(seq, 100.5)  # first token: TTFT 0.5 s
    seq.last_token_time = 100.5
    m.on_token(seq, 100.6)  # then ITL 0.1 s
    m.on_uplink(2048, "fp16", 16)
    m.on_downlink(40)
    m.on_edge_round_trip(0.003)
    m.on_engine_time(0.0055, 0.0031)
    m.on_device_step(0.0052)
    m.on_batch(True)
    m.on_batch(True)
    m.on_batch(False)
    s = _samples(m)
    assert s[("autoglm:engine_step_seconds_bucket", (("le", "0.006"),) + lab)] == 1
    assert s[("autoglm:engine_step_seconds_bucket", (("le", "0.005"),) + lab)] == 0
    assert abs(s[("autoglm:engine_input_wait_seconds_sum", lab)] - 0.0031) < 1e-12
    # device time in 0.25 ms buckets: 5.2 ms is above 5.0 and within 5.25
    assert s[("autoglm:engine_device_step_seconds_bucket", (("le", "0.00525"),) + lab)] == 1
    assert s[("autoglm:engine_device_step_seconds_bucket", (("le", "0.005"),) + lab)] == 0
    assert s[("autoglm:engine_forward_passes_total", passes["persistent"])] == 2
    assert s[("autoglm:engine_forward_passes_total", passes["rebuilt"])] == 1
    assert s[("autoglm:edge_round_trip_seconds_count", lab)] == 1
    assert s[("autoglm:edge_round_trip_seconds_bucket", (("le", "0.004"),) + lab)] == 1
    assert s[("autoglm:edge_round_trip_seconds_bucket", (("le", "0.002"),) + lab)] == 0
    assert s[("vllm:time_to_first_token_seconds_sum", lab)] == 0.5
    assert abs(s[("vllm:inter_token_latency_seconds_sum", lab)] - 0.1) < 1e-9
    assert s[("vllm:prefix_cache_hits_total", lab)] == 16 and s[("vllm:prefix_cache_queries_total", lab)] == 20
    assert s[("vllm:generation_tokens_total", lab)] == 2
    codec = (("codec", "fp16"), ("model_name", "glm"))
    assert s[("autoglm:uplink_bytes_total", codec)] == 2048
    assert s[("autoglm:uplink_bytes_per_token_sum", codec)] == 128
    assert s[("autoglm:downlink_bytes_total", lab)] == 40


def test_several_processes_metrics_merge_into_one_exposition_with_their_sums():
    from prometheus_client.parser import text_string_to_metric_families as parse

    from cloud_server.metrics import render_merged

    engine, w0, w1 = ServerMetrics("glm"), ServerMetrics("glm"), ServerMetrics("glm")
    seq = SimpleNamespace(num_prompt_tokens=4, num_cached_tokens=0, prefix_keys=[], variant="fp32",
                          arrival_time=0.0, last_token_time=None, finish_reason="stop")
    engine.on_admit(seq)
    engine.on_token(seq, 0.25)
    w0.on_downlink(40)
    w1.on_downlink(60)
    w0.sessions.labels("glm").set(2)
    w1.sessions.labels("glm").set(1)
    w1.on_uplink(512, "fp16", 4)  # a codec only one worker has seen
    text = render_merged([list(m.registry.collect()) for m in (engine, w0, w1)]).decode()
    s = {(x.name, tuple(sorted(x.labels.items()))): x.value for f in parse(text) for x in f.samples}
    lab = (("model_name", "glm"),)
    assert s[("vllm:generation_tokens_total", lab)] == 1 and s[("vllm:time_to_first_token_seconds_count", lab)] == 1
    assert s[("autoglm:downlink_bytes_total", lab)] == 100 and s[("autoglm:sessions_open", lab)] == 3
    assert s[("autoglm:uplink_bytes_total", (("codec", "fp16"), ("model_name", "glm")))] == 512
    created = [m.downlink.labels("glm")._created for m in (engine, w0, w1)]
    assert s[("autoglm:downlink_bytes_created", lab)] == min(created)  # a timestamp: the earliest, not a sum
    assert text.count("# TYPE vllm:generation_tokens_total") == 1
    # the refusal series every process creates at 0 (--workers): one series each, not one per process
    assert text.count('autoglm:http_requests_refused_total{model_name="glm",reason="draining",status="503"}') == 1
    assert text.count('autoglm:sessions_refused_total{model_name="glm",reason="overloaded"}') == 1
    assert render_merged([list(engine.registry.collect())]) == engine.render()  # one process: unchanged


def test_a_long_request_lands_in_a_finite_bucket():
    """The end-to-end and first-token histograms ended at 80 s: a split generation over a mobile link (a round trip
    per token: 1000 tokens at 150 ms is 150 s) counted in +Inf only, and every quantile of them read 80 s."""
    m = ServerMetrics("glm")
    seq = SimpleNamespace(arrival_time=0.0, last_token_time=None, finish_reason="stop")
    m.on_token(seq, 100.0)  # a first token after 100 s in the admission queue
    seq.arrival_time = time.monotonic() - 150.0
    m.on_finish(seq)
    s, lab = _samples(m), (("model_name", "glm"),)
    for name, above, within in (("vllm:e2e_request_latency_seconds", "120.0", "240.0"),
                                ("vllm:time_to_first_token_seconds", "80.0", "120.0")):
        assert s[(name + "_bucket", (("le", above),) + lab)] == 0, name
        assert s[(name + "_bucket", (("le", within),) + lab)] == 1, name


def test_the_per_token_histograms_bucket_like_prometheus_and_merge_across_processes():
    """TTFT / ITL / round trip and the token counter are fed once per token by the engine thread through a lighter
    collector (``_HotHistogram``): the same exposition as prometheus_client's Histogram - a value on a bound counts
    in that bucket (le), cumulative buckets, count = +Inf - and summed across processes like any other series."""
    from prometheus_client import CollectorRegistry, Histogram
    from prometheus_client.parser import text_string_to_metric_families as parse

    from cloud_server.metrics import _ROUND_TRIP_BUCKETS, render_merged

    values = [0.0, 0.00025, 0.0003, 0.001, 0.004, 0.0041, 4.9, 5.0, 7.5, 0.004]  # on bounds, between, above the last
    ours, reg = ServerMetrics("glm"), CollectorRegistry()
    ref = Histogram("autoglm:edge_round_trip_seconds", "x", ["model_name"], buckets=_ROUND_TRIP_BUCKETS, registry=reg)
    for v in values:
        ours.on_edge_round_trip(v)
        ref.labels("glm").observe(v)

    def series(families, name):
        return {(x.name, tuple(sorted(x.labels.items()))): x.value for f in families for x in f.samples
                if x.name.startswith(name) and not x.name.endswith("_created")}

    name = "autoglm:edge_round_trip_seconds"
    assert series(ours.registry.collect(), name) == series(reg.collect(), name)
    other = ServerMetrics("glm")
    other.on_edge_round_trip(0.004)
    merged = series(parse(render_merged([list(m.registry.collect()) for m in (ours, other)]).decode()), name)
    lab = (("le", "0.004"), ("model_name", "glm"))
    assert merged[(name + "_bucket", lab)] == 7 and merged[(name + "_count", (("model_name", "glm"),))] == 11
