"""Prometheus metrics of the cloud server, on a registry of its own (several servers may share a process).

Names follow vLLM's so existing dashboards work: ``vllm:time_to_first_token_seconds``,
``vllm:inter_token_latency_seconds``, ``vllm:e2e_request_latency_seconds``, ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries`` /
``vllm:prefix_cache_hits`` (tokens), ``vllm:prompt_tokens`` / ``vllm:generation_tokens``,
``vllm:request_success`` (by finish reason). Split-specific ones carry the ``autoglm:`` prefix: wire bytes up
(edge -> cloud hidden states) and down (tokens), bytes per token by codec, open and refused sessions, HTTP requests
answered with an error status (``autoglm:http_requests_refused_total{status, reason}``, :class:`HttpRefusals`), the
edges' round trip per token (``autoglm:edge_round_trip_seconds``, measured at the engine), and where the engine
thread's time goes per step: in the step (``autoglm:engine_step_seconds``) or waiting for inputs while requests
are open (``autoglm:engine_input_wait_seconds``), the steady decode step's device time on CUDA
(``autoglm:engine_device_step_seconds``: the engine step minus it is the host's share), and how each forward pass's
batch was made (``autoglm:engine_forward_passes_total{batch="persistent"|"rebuilt"}``).

In split mode the latencies are measured at the cloud between a request's arrival and its sampled tokens,
so the inter-token latency includes the edge's round trip (what a user waits for); durations only, never
timestamps of another machine.

Several processes (``--workers N``): the engine process counts the engine's series, each front-end worker the
network's (its own :class:`ServerMetrics`); :func:`render_merged` sums their samples into one exposition with
the same names, so a dashboard reads one server. A worker that has not started yet adds nothing, one slow to
answer its last families, and one that died its counters and histograms (:func:`lasting`): a summed counter never
goes down while the server runs.
"""

from __future__ import annotations

import json
import math
import re
import time
from bisect import bisect_left
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from cloud_server.limits import PROBES

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    10.0, 20.0, 40.0, 80.0)
# a whole request, and a first token that waited for admission: minutes to a long generation over a mobile link (a
# round trip per token), so vLLM's tail up to 7680 s - above 80 s every quantile read 80
_REQUEST_BUCKETS = (*_LATENCY_BUCKETS, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# an edge's round trip per token: localhost (sub-millisecond) to a slow mobile link
_ROUND_TRIP_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512,
                       1.0, 2.0, 5.0)
# an engine step: 1 ms apart up to 8 (an H200's decode steps are 3.5-6 ms), then doubling
_STEP_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.010, 0.012, 0.016, 0.024, 0.032, 0.064,
                 0.128, 0.256, 0.512, 1.0, 2.0, 5.0)
# a steady decode step on the device: 0.25 ms apart from 2 to 8 ms (host share = engine step - device time), then
# doubling
_DEVICE_BUCKETS = (0.0005, 0.001, 0.0015, *(round(0.002 + 0.00025 * i, 5) for i in range(25)), 0.010, 0.012, 0.016, 0.024,
                   0.032, 0.064, 0.128, 0.256, 0.512, 1.0)
_BYTES_BUCKETS = (64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)


ALERTED_HTTP_REFUSALS = (("429", "overloaded"), ("503", "draining"))  # (status, reason) at 0 from the start
ALERTED_SESSION_REFUSALS = ("overloaded", "key_session_cap", "max_connections", "draining")


class _HotHistogram:
    """A histogram of one label set fed once per token or row by the engine thread: ``observe`` is a bisect and
    two adds (prometheus_client's takes a lock per bucket and sum, ~2 us: 64 rows a step add up). One writer
    thread; a scrape reads the bucket counts in one pass and derives the count from them, so a scrape during a
    step may miss that step's latest observations but never exposes a count that disagrees with its buckets."""

    def __init__(self, name: str, doc: str, labels: dict[str, str], buckets: tuple[float, ...],
                 registry: CollectorRegistry):
        self.name, self.doc, self.labels = name, doc, labels
        self.bounds = list(buckets)  # ascending; +Inf is the last count
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le semantics: the first bound >= value
        self.sum += value

    def collect(self):
        counts, total, cum, buckets = list(self.counts), self.sum, 0, []
        for bound, c in zip((*self.bounds, math.inf), counts):
            cum += c
            buckets.append((floatToGoString(bound), cum))
        fam = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        fam.add_metric(list(self.labels.values()), buckets, total)
        yield fam


class _HotCounter:
    """A counter of one label set incremented per token by the engine thread (see :class:`_HotHistogram`)."""

    def __init__(self, name: str, doc: str, labels: dict[str, str], registry: CollectorRegistry):
        self.name, self.doc, self.labels, self.value = name, doc, labels, 0
        registry.register(self)

    def inc(self, amount: int = 1) -> None:
        self.value += amount

    def collect(self):
        fam = CounterMetricFamily(self.name, self.doc, labels=list(self.labels))
        fam.add_metric(list(self.labels.values()), self.value)
        yield fam


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        self._engine = None  # the engine whose pool and queues the gauges read (bound at its first step)
        lab = ["model_name"]
        self.model_name = model_name
        one = {"model_name": model_name}  # the per-token series: fed by the engine thread (_HotHistogram)
        self.ttft = _HotHistogram("vllm:time_to_first_token_seconds", "Time to first token", one, _REQUEST_BUCKETS, r)
        self.itl = _HotHistogram("vllm:inter_token_latency_seconds", "Inter-token latency", one, _LATENCY_BUCKETS, r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", lab,
                             buckets=_REQUEST_BUCKETS, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests holding KV blocks", lab, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for admission", lab, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", lab, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      lab, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens served by the prefix cache", lab,
                                   registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens received", lab, registry=r)
        self.generation_tokens = _HotCounter("vllm:generation_tokens", "Tokens generated", one, r)
        self.batched_tokens = Counter("autoglm:engine_step_tokens", "Tokens run through the layers", lab,
                                      registry=r)
        self.success = Counter("vllm:request_success", "Finished requests", lab + ["finished_reason"], registry=r)
        self.uplink = Counter("autoglm:uplink_bytes", "Bytes received from edges (hidden states)", lab + ["codec"],
                              registry=r)
        self.downlink = Counter("autoglm:downlink_bytes", "Bytes sent to edges", lab, registry=r)
        self.bytes_per_token = Histogram("autoglm:uplink_bytes_per_token", "Encoded hidden-state bytes per token",
                                         lab + ["codec"], buckets=_BYTES_BUCKETS, registry=r)
        self.sessions = Gauge("autoglm:sessions_open", "Split sessions open (connected or resumable)", lab,
                              registry=r)
        self.refused = Counter("autoglm:sessions_refused", "Sessions refused", lab + ["reason"], registry=r)
        self.http_refused = Counter("autoglm:http_requests_refused",
                                    "HTTP requests (not the probes) answered with an error status, by status and "
                                    "the error body's code", lab + ["status", "reason"], registry=r)
        self.engine_step = Histogram("autoglm:engine_step_seconds",
                                     "Engine thread: time in one step (launch, wait for the device, postprocess), "
                                     "per step that delivered outputs", lab, buckets=_STEP_BUCKETS, registry=r)
        self.engine_wait = Histogram("autoglm:engine_input_wait_seconds",
                                     "Engine thread: time between two steps spent waiting for (and taking) inputs "
                                     "while requests were open - the edges' round trips, the gather window", lab,
                                     buckets=_STEP_BUCKETS, registry=r)
        self.device_step = Histogram("autoglm:engine_device_step_seconds",
                                     "Device time of a steady decode step (the persistent batch; CUDA events from "
                                     "its graph replay to its ids' copy to the host)", lab,
                                     buckets=_DEVICE_BUCKETS, registry=r)
        self.forward_passes = Counter("autoglm:engine_forward_passes",
                                      "Forward passes by how their batch was made: 'persistent' (the last decode "
                                      "batch one position on, rows handed to the runner as they are) or 'rebuilt'",
                                      lab + ["batch"], registry=r)
        self.round_trip = _HotHistogram("autoglm:edge_round_trip_seconds",
                                        "Split decoding: a token leaving the engine -> the edge's next state reaching "
                                        "it (link both ways, the phone's front step, the server's front end)", one,
                                        _ROUND_TRIP_BUCKETS, r)
        self.preemptions = Counter("vllm:num_preemptions", "Requests the engine dropped for load (running "
                                   "requests outgrew the KV pool) that full-model mode replayed (a split request's "
                                   "replay is its edge's)", lab, registry=r)
        self.variant_requests = Counter("autoglm:requests_by_variant", "Requests by compute variant",
                                        lab + ["variant"], registry=r)
        # Series exist from the start (0), so dashboards and alerts see them before the first request.
        for m in (self.e2e, self.running, self.waiting, self.kv_usage, self.prefix_queries,
                  self.prefix_hits, self.prompt_tokens, self.batched_tokens,
                  self.downlink, self.sessions, self.engine_step, self.engine_wait,
                  self.device_step, self.preemptions):
            m.labels(model_name)
        # The refusals an operator alerts on are series from the start too (0), so that a rate of them needs no
        # `or vector(0)` until the first: the HTTP 429 of --max-http-requests and 503 of a drain, the sessions
        # refused for load (--max-sessions, a key's cap, --max-connections) and for a drain.
        for status, reason in ALERTED_HTTP_REFUSALS:
            self.http_refused.labels(model_name, status, reason)
        for reason in ALERTED_SESSION_REFUSALS:
            self.refused.labels(model_name, reason)
        # Bound children for the per-token hooks: ``labels()`` costs a lock and a dict lookup per call, and
        # these run once per token (engine thread) or per frame (event loop).
        self._e2e = self.e2e.labels(model_name)
        self._engine_step, self._engine_wait = self.engine_step.labels(model_name), self.engine_wait.labels(model_name)
        self._device_step = self.device_step.labels(model_name)
        self._passes = (self.forward_passes.labels(model_name, "rebuilt"),
                        self.forward_passes.labels(model_name, "persistent"))  # series from the start, both
        self._batched_tokens = self.batched_tokens.labels(model_name)
        self._downlink = self.downlink.labels(model_name)
        self._uplink_by_codec: dict[str, tuple] = {}  # codec -> (uplink child, bytes_per_token child)

    # -- engine hooks (called from the engine thread) ------------------------------------------
    def on_admit(self, seq) -> None:
        """``seq``'s whole prompt has arrived (the chunk ending its first input turn: the engine calls it then, so
        a prompt sent in chunks counts all its positions)."""
        m = self.model_name
        self.prompt_tokens.labels(m).inc(seq.num_prompt_tokens)
        if seq.prefix_keys:
            self.prefix_queries.labels(m).inc(seq.num_prompt_tokens)
            self.prefix_hits.labels(m).inc(seq.num_cached_tokens)
        self.variant_requests.labels(m, seq.variant).inc()

    def on_token(self, seq, now: float) -> None:
        self.generation_tokens.inc()
        if seq.last_token_time is None:
            self.ttft.observe(now - seq.arrival_time)
        else:
            self.itl.observe(now - seq.last_token_time)

    def on_finish(self, seq) -> None:
        self._e2e.observe(time.monotonic() - seq.arrival_time)
        self.success.labels(self.model_name, seq.finish_reason or "abort").inc()

    def on_preemption(self) -> None:
        """Full-model mode replays a request the engine dropped for load (event loop)."""
        self.preemptions.labels(self.model_name).inc()

    def on_edge_round_trip(self, seconds: float) -> None:
        self.round_trip.observe(seconds)

    def on_engine_time(self, step_s: float, wait_s: float) -> None:
        """One delivering step of the engine thread: its time in the step, and its wait for inputs before it."""
        self._engine_step.observe(step_s)
        self._engine_wait.observe(wait_s)

    def on_device_step(self, seconds: float) -> None:
        """A steady decode step's device time (CUDA): beside ``engine_step_seconds`` it says what the host adds."""
        self._device_step.observe(seconds)

    def on_step(self, engine, num_tokens: int) -> None:
        m = self.model_name
        if self._engine is not engine:  # read at scrape time: an abort frees KV without a step after it
            self._engine = engine
            self.running.labels(m).set_function(lambda: engine.scheduler.num_running)
            self.waiting.labels(m).set_function(lambda: engine.scheduler.num_waiting)
            self.kv_usage.labels(m).set_function(engine.kv_usage)
        if num_tokens:
            self._batched_tokens.inc(num_tokens)

    def on_batch(self, persistent: bool) -> None:
        """A forward pass: on the persistent decode batch, or on a batch rebuilt from its chunks."""
        self._passes[persistent].inc()

    # -- network hooks ----------------------------------------------------------------------------
    def _uplink_children(self, codec: str) -> tuple:
        children = self._uplink_by_codec.get(codec)
        if children is None:  # codecs are a handful of known names (negotiated), so this stays small
            children = self._uplink_by_codec[codec] = (self.uplink.labels(self.model_name, codec),
                                                       self.bytes_per_token.labels(self.model_name, codec))
        return children

    def on_uplink(self, nbytes: int, codec: str, tokens: int) -> None:
        children = self._uplink_children(codec)
        children[0].inc(nbytes)
        if tokens:
            children[1].observe(nbytes / tokens)

    def on_uplink_steps(self, sizes: list[int], codec: str) -> None:
        """A loop turn's decode steps in ``codec`` (one token each, frames of ``sizes`` bytes): the byte counter
        moves once, each step is one observation of bytes per token."""
        children = self._uplink_children(codec)
        children[0].inc(sum(sizes))
        for n in sizes:
            children[1].observe(n)

    def on_refused(self, reason: str) -> None:
        """A session refused (``reason``: a protocol error code, ``key_session_cap``, ``max_connections``: a fixed
        set, never a client's words)."""
        self.refused.labels(self.model_name, reason).inc()

    def on_http_refused(self, status: int, reason: str) -> None:
        """An HTTP request answered ``status`` >= 400 (``reason``: the server's own error code, see
        :class:`HttpRefusals`)."""
        self.http_refused.labels(self.model_name, str(status), reason).inc()

    def on_downlink(self, nbytes: int) -> None:
        self._downlink.inc(nbytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)


_CODE = re.compile(r"[a-z0-9_]{1,64}")


class HttpRefusals:
    """ASGI middleware (the outermost, so the connection cap's 503s and ``--max-http-requests``' 429s are seen too):
    every HTTP request but the probes answered with a status >= 400 is counted by ``metrics()`` (None: nothing to
    count in yet) under its status and its reason, the ``code`` of its OpenAI error body (``overloaded``,
    ``draining``, ``unavailable``, ``context_length_exceeded``, ``invalid_request_error``, ``invalid_api_key``,
    ``not_found``, ...: the server's own words, never a client's), ``other`` for a body without one, ``internal`` for
    an exception before any answer. No path label: a scanner's 404s add one series, not one per path."""

    def __init__(self, app, metrics: Callable[[], ServerMetrics | None]):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PROBES:
            await self.app(scope, receive, send)
            return
        status = None  # the answer's, once started; counted at its first body message

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status is not None and status >= 400:
                self._count(status, _error_code(message.get("body", b""), message.get("more_body", False)))
                status = None
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            if status is None:  # nothing answered: starlette's 500 follows
                self._count(500, "internal")
            raise

    def _count(self, status: int, reason: str) -> None:
        metrics = self.metrics()
        if metrics is not None:
            metrics.on_http_refused(status, reason)


def _error_code(body: bytes, more: bool) -> str:
    """The ``code`` of an OpenAI error body (whole in one message), else ``other``."""
    try:
        code = json.loads(body)["error"]["code"] if not more else None
    except (ValueError, KeyError, TypeError):
        code = None
    return code if isinstance(code, str) and _CODE.fullmatch(code) else "other"


def render_merged(collections: list[list[Metric]]) -> bytes:
    """One exposition of several processes' metric families (``registry.collect()`` of each), by :func:`merge`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(merge(collections)))
    return generate_latest(registry)


def lasting(families: list[Metric]) -> list[Metric]:
    """What a process that is gone (a front-end worker that died) still adds to the merged exposition: its counters
    and histograms, so that their sums never go down (Prometheus reads any drop as a reset and counts the whole
    sum again as new), as prometheus_client's multiprocess mode keeps a dead process's; not its gauges (its open
    sessions are gone with it)."""
    return [fam for fam in families if fam.type != "gauge"]


def merge(collections: list[list[Metric]]) -> list[Metric]:
    """Several processes' metric families as one list: samples of the same name and labels are summed
    (counters, histograms, and gauges such as open sessions, which each process counts for its own part),
    ``*_created`` timestamps take the earliest."""
    merged: dict[str, Metric] = {}
    values: dict[str, dict[tuple, Sample]] = {}
    for families in collections:
        for fam in families:
            if fam.name not in merged:
                merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                values[fam.name] = {}
            into = values[fam.name]
            for smp in fam.samples:
                key = (smp.name, tuple(sorted(smp.labels.items())))
                old = into.get(key)
                if old is None:
                    into[key] = smp
                else:
                    both = (min if smp.name.endswith("_created") else sum)((old.value, smp.value))
                    into[key] = old._replace(value=both)
    for name, fam in merged.items():
        fam.samples = list(values[name].values())
    return list(merged.values())


class _Families:
    """A collector yielding fixed metric families (what :func:`render_merged` built)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return iter(self.families)
