"""``autoglm-partition plan``: choose the split layer N from measured costs (Neurosurgeon-style).

Costs, each measured on this machine unless said otherwise:

* edge: per-layer time of the real ONNX front (int8, the split's recipe) run by the edge runtime
  (``edge_client.front.FrontRuntime``) at the requested threads, for a prefill chunk (per token) and for
  one decode step at the workload's context length; a bundle's own front is timed when ``--bundle`` is
  given, else a probe bundle of a few layers is split;
* cloud: per-layer time of the model's own decoder layer in torch on this CPU (prefill per token, decode at
  the context length) plus the final norm + lm_head, or the GPU figures of ``docs/results/cloud_gpu.json``
  (``--cloud-results``; GLM-4.1V-9B layers on an H200, scaled by weight bytes for another model);
* link: the profile (``shared.link_profiles``): one-way delay, bandwidth each way, loss as RTO spikes;
* bytes per boundary token for every codec (real boundary states of the model at each N);
* edge memory: the front's weights, its KV cache at the context length, the cached system prompt.

The latency model per candidate N (chunks of ``prefill_chunk`` tokens pipeline through edge compute ->
uplink -> cloud compute; decode pays one round trip per token):

    TTFT(N)      = pipeline(edge_prefill(N), upload, cloud_prefill(L - N)) + head + RTT + overhead
    per-token(N) = edge_decode(N) + up(bytes/token) + cloud_decode(L - N) + head + RTT + down + overhead

and the baselines: all-cloud (text up, every layer in the cloud, tokens stream down without a round trip
per token) and all-edge (every layer + lm_head on the phone, no link; timed on the whole-model graph when
``whole`` is given, else projected from the front's per-layer time). ``overhead`` is the software cost the
layer timings miss (asyncio, msgpack, the engine's step); a fixed guess unless calibrated (the rig measures
it on a loopback link: ``rig.plan_check``). The pick minimises the agent step
(TTFT + output tokens x per-token) among the splits that fit the edge memory budget.

Reference: Kang et al., "Neurosurgeon: Collaborative Intelligence Between the Cloud and Mobile Edge"
(ASPLOS 2017): per-layer latency and output-size models pick the partition point per network.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from shared.link_profiles import MSS, LinkProfile
from shared.threads import threads_problem

from .adapters import ModelAdapter, call_layer
from .models import LoadedModel
from .privacy import recovered_fraction
from .progress import Steps

UP_MSG_OVERHEAD = 90  # bytes: a DecodeStep's msgpack header + WebSocket frame around the coded hidden state
DOWN_PER_TOKEN = 60  # bytes: one token message (id, text delta, framing) down the WebSocket
SSE_PER_TOKEN = 200  # bytes: one streamed chat.completion.chunk (all-cloud)
HTTP_REQUEST_OVERHEAD = 250  # bytes: request line + headers of the all-cloud POST


class PlanError(ValueError):
    """Bad planner input; one-line message."""


@dataclass(frozen=True, slots=True)
class Shape:
    """One request's token counts: what the latency model is evaluated on."""

    prompt_tokens: int  # all of the prompt
    cached_tokens: int  # of those, served by both caches (the agent's system prompt after step 1)
    output_tokens: int
    text_bytes: int = 0  # the prompt as UTF-8 text (what all-cloud uploads)

    @property
    def uncached(self) -> int:
        return max(1, self.prompt_tokens - self.cached_tokens)


@dataclass(slots=True)
class PlanConfig:
    link: LinkProfile
    edge_threads: int = 2
    cloud_threads: int = 1  # torch threads of the CPU cloud measurement
    edge_cores: list[int] | None = None  # pin the edge measurement here (the rig's phone cores)
    cloud_cores: list[int] | None = None
    cloud_results: Path | None = None  # docs/results/cloud_gpu.json: GPU cloud costs instead of measuring
    codec: str = "int8-outlier"  # wire codec of the prediction (every codec's bytes are reported)
    edge_memory_mb: float = 1024.0  # budget for the front's weights + KV + cached prompt on the phone
    prefill_chunk: int = 128  # the edge's prefill chunk (EdgeConfig.prefill_chunk)
    probe_layers: int = 2  # layers of the probe front exported when no bundle is given
    overhead_ms: float = 3.0  # software cost per round trip (msgpack, asyncio, engine step) when not calibrated
    # calibrated software overheads, seconds: {"split" | "all-cloud": (ttft_s, per_token_s)}, e.g. measured by
    # the rig on a loopback link (rig.plan_check); they replace overhead_ms for that mode
    overheads: dict = field(default_factory=dict)
    whole: Path | None = None  # a whole-model export (partition_tools.export_whole): all-edge timed on it
    chat: Shape = field(default_factory=lambda: Shape(48, 0, 48, 200))
    agent: Shape = field(default_factory=lambda: Shape(780, 660, 24, 3100))
    candidates: list[int] | None = None  # split layers to evaluate (default: a spread over [1, L))

    def __post_init__(self):
        from shared.codecs import BASIS_CODECS, CODEC_NAMES

        for flag, n in (("--edge-threads", self.edge_threads), ("--cloud-threads", self.cloud_threads)):
            if (problem := threads_problem(n)) is not None:
                raise PlanError(f"{flag} {problem}")
        sized = [c for c in CODEC_NAMES if c not in BASIS_CODECS]  # the codecs codec_bytes_per_token sizes
        if self.codec not in sized:
            raise PlanError(f"--codec {self.codec!r}: expected one of {', '.join(sized)}")
        if not 0 < self.edge_memory_mb < math.inf:  # inf (or 1e400) printed 'Infinity' in --json: no JSON
            raise PlanError(f"--edge-memory-mb {self.edge_memory_mb:g}: expected > 0 and finite")
        if self.candidates is not None and (not self.candidates or min(self.candidates) < 1):
            raise PlanError(f"--candidates {self.candidates}: expected split layers >= 1")
        if self.candidates is not None:  # each once, in order (--candidates 8,2,8 printed and timed rows twice)
            self.candidates = sorted(set(self.candidates))
        if self.cloud_results is not None:
            read_cloud_results(self.cloud_results)


# -- measurements ---------------------------------------------------------------------------------


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up: allocations, graph caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _Pinned:
    """Run a measurement on the given cores (restores the affinity after)."""

    def __init__(self, cores: list[int] | None):
        self.cores = cores
        self.saved = None

    def __enter__(self):
        if self.cores:
            self.saved = os.sched_getaffinity(0)
            os.sched_setaffinity(0, set(self.cores))

    def __exit__(self, *exc):
        if self.saved is not None:
            os.sched_setaffinity(0, self.saved)


def edge_layer_times(bundle: Path, threads: int, chunk: int, contexts: list[int]) -> dict:
    """Per-layer seconds of a bundle's real edge front (``edge_client.front.FrontRuntime``, whatever graph
    kind the bundle carries): prefill per token (one chunk at P = 0) and one decode step at each context."""
    from edge_client.front import FrontRuntime

    rt = FrontRuntime(bundle, threads=threads, chunk=chunk, capacity=max(contexts) + chunk + 8)
    if max(contexts) >= rt.max_positions:  # (a FrontError traceback: '792 positions exceed the edge graph's 512')
        raise PlanError(f"the model's edge graph holds {rt.max_positions} positions (its context), fewer than the "
                        f"{max(contexts) + 1} plan times a decode step at (its agent step's context)")
    n = rt.n_layers
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(4, min(rt.vocab_size, 1000), max(chunk, *contexts))]

    def prefill_chunk():
        rt.reset()
        rt.prefill(ids[:chunk])

    prefill = _median_time(prefill_chunk, 3) / chunk / n
    decode = {}
    for ctx in contexts:
        rt.reset()
        rt.prefill(ids[:ctx])

        def step(ctx=ctx):
            rt.decode(7)
            rt.truncate(ctx)  # keep the context length fixed across repeats

        decode[ctx] = _median_time(step, 10) / n
    return {"prefill_per_token": prefill, "decode": decode, "graph": rt.graph_kind}


def whole_model_times(whole_dir: Path, threads: int, chunk: int, contexts: list[int]) -> dict:
    """Seconds of the whole-model graph (``export_whole``'s interface): prefill per token, one decode step
    (all layers + lm_head) at each context."""
    import onnxruntime as ort

    from shared.whole_model import WHOLE_GRAPH, WHOLE_META

    meta = json.loads((Path(whole_dir) / WHOLE_META).read_text())
    n, kvh, d = int(meta["num_layers"]), int(meta["num_kv_heads"]), int(meta["head_dim"])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(Path(whole_dir) / WHOLE_GRAPH), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    vocab = min(int(meta["vocab_size"]), 1000)

    def feeds(s: int, p: int) -> dict:
        f = {"input_ids": rng.integers(4, vocab, (1, s)).astype(np.int64),
             "position_ids": np.arange(p, p + s, dtype=np.int64)[None]}
        for i in range(n):
            for kv in ("key", "value"):
                f[f"past_{kv}.{i}"] = rng.standard_normal((1, kvh, p, d)).astype(np.float32)  # [1, KVH, P, D]
        return f

    pre = feeds(chunk, 0)
    out = {"prefill_per_token": _median_time(lambda: sess.run(None, pre), 3) / chunk, "decode": {}}
    for ctx in contexts:
        dec = feeds(1, ctx)
        out["decode"][ctx] = _median_time(lambda d=dec: sess.run(None, d), 10)
    return out


def _probe_bundle(lm: LoadedModel, k: int, tmp: Path) -> Path:
    """A throwaway bundle split at ``k`` with the int8 edge recipe: a real front to time. (It also writes
    the cloud half: for a large model, pass an existing bundle instead.)"""
    from .split import SplitConfig, split

    out = tmp / "probe"
    split(lm, SplitConfig(layer=k, out=out, edge_quant="int8"))
    return out


@torch.no_grad()
def cloud_layer_times(adapter: ModelAdapter, threads: int, chunk: int, contexts: list[int]) -> dict:
    """Per-layer seconds of the model's own decoder layer in torch on this CPU, and the head's decode cost."""
    from .export import _ExportCache

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layer = adapter.layers[0]
        h = adapter.hidden_size
        x = torch.randn(1, chunk, h)  # [1, S, H]
        pos = torch.arange(chunk)[None]
        cs = adapter.position_embeddings(x, pos)
        prefill = _median_time(lambda: call_layer(layer, x, attention_mask=None, position_ids=pos,
                                                  position_embeddings=cs), 3) / chunk
        decode = {}
        kw = adapter.cache_kwarg()
        for ctx in contexts:
            past = [torch.randn(1, adapter.num_kv_heads, ctx, adapter.head_dim) for _ in range(2)]
            x1 = torch.randn(1, 1, h)  # [1, 1, H]
            p1 = torch.tensor([[ctx]])
            cs1 = adapter.position_embeddings(x1, p1)
            idx = getattr(getattr(layer, "self_attn", None), "layer_idx", 0) or 0
            padded = [past[0]] * (2 * idx) + past  # _ExportCache indexes by the layer's own index

            def step(x1=x1, p1=p1, cs1=cs1, padded=padded):
                call_layer(layer, x1, attention_mask=None, position_ids=p1, position_embeddings=cs1,
                           **{kw: _ExportCache(list(padded))})

            decode[ctx] = _median_time(step, 10)
        x1 = torch.randn(1, 1, h)
        head = _median_time(lambda: adapter.lm_head(adapter.norm(x1)), 10)
    finally:
        torch.set_num_threads(saved)
    return {"prefill_per_token": prefill, "decode": decode, "head": head}


def read_cloud_results(path: Path) -> tuple[int, float, float, float]:
    """The measured model's layers, decode step (s), prefill tokens/s and per-layer weights from ``cloud_gpu.json``;
    PlanError unless the file is one with each of them finite and > 0 (a zero was a ZeroDivisionError, a NaN a
    plan of 'nan ms' picking its first candidate). PlanConfig reads it before anything is measured."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"--cloud-results {path}: not JSON ({e})") from None
    except OSError as e:  # (was "[Errno 21] Is a directory: '/etc'", naming no flag)
        raise PlanError(f"--cloud-results {path}: {e.strerror or e}") from None
    try:
        m = data["model"]
        layers = int(m["num_layers"])
        step_ms = float(data["step_ms_s1"])
        prefill_tps = float(data["fast"]["1"]["prefill_tokens_per_s"])
        ref_layer = float(m["hidden_size"] * (m["num_heads"] + 2 * m["num_kv_heads"]) * m["head_dim"]
                          + m["num_heads"] * m["head_dim"] * m["hidden_size"]
                          + 3 * m["hidden_size"] * m["intermediate_size"])
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise PlanError(f"--cloud-results {path}: not a cloud_gpu.json with model/step_ms_s1/fast ({e})") from None
    for name, v in (("model.num_layers", layers), ("step_ms_s1", step_ms), ("fast.1.prefill_tokens_per_s", prefill_tps),
                    ("the model's layer size", ref_layer)):
        if not (math.isfinite(v) and v > 0):
            raise PlanError(f"--cloud-results {path}: {name} {v:g}: expected a number > 0")
    return layers, step_ms / 1000.0, prefill_tps, ref_layer


def cloud_gpu_times(path: Path, adapter: ModelAdapter, contexts: list[int]) -> dict:
    """Per-layer GPU costs from ``cloud_gpu.json`` (batch 1 decode step, prefill tokens/s), scaled by the
    ratio of this model's layer weight bytes to the measured model's (decode is memory-bound)."""
    layers, step_s, prefill_tps, ref_layer = read_cloud_results(path)
    scale = sum(p.numel() for p in adapter.layers[0].parameters()) / ref_layer
    per_layer = step_s / layers * scale
    return {"prefill_per_token": scale / prefill_tps / layers, "decode": {c: per_layer for c in contexts},
            "head": 0.0, "source": str(path), "scale": scale}


def codec_bytes_per_token(lm: LoadedModel, adapter: ModelAdapter, layers: list[int], calibration_tokens: int = 128
                          ) -> dict[int, dict[str, float]]:
    """Wire bytes per boundary token, per codec, on the model's real boundary states at each split layer."""
    from shared.codecs import BASIS_CODECS, CALIBRATED_CODECS, CODEC_NAMES, find_outlier_channels, find_sink_threshold, get_codec

    from .split import boundary_hidden, calibration_ids

    ids = calibration_ids(lm, adapter, calibration_tokens)
    out = {}
    for n in layers:
        hid = boundary_hidden(adapter, ids, n)[0].float().numpy()  # [T, H]
        channels = find_outlier_channels(hid, 8)
        row = {}
        for name in CODEC_NAMES:
            if name in BASIS_CODECS:  # needs a bundle's codec artifact; sized by bench/codec_bench.py
                continue
            params = ({"outlier_channels": channels, "sink_threshold": find_sink_threshold(hid, channels)}
                      if name in CALIBRATED_CODECS else {})
            row[name] = len(get_codec(name, **params).encode_payload(hid)) / hid.shape[0]
        out[n] = row
    return out


# -- the model ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Costs:
    num_layers: int
    edge: dict  # prefill_per_token, decode{ctx}
    cloud: dict  # prefill_per_token, decode{ctx}, head
    codec_bytes: dict[int, dict[str, float]]
    layer_weight_bytes: float  # int8 front layer on the phone (weights + block scales)
    embed_weight_bytes: float
    head_edge_s: float  # the lm_head on the phone, per step (all-edge projected from the front's layers)
    kv_bytes_per_token_layer: int
    hidden_size: int
    whole: dict | None = None  # all-edge timed on the whole-model graph: prefill_per_token, decode{ctx}


def _pipeline(chunks: list[int], edge_tok: float, up_tok_s: float, up_msg_s: float, cloud_tok: float,
              one_way: float) -> float:
    """Finish time of the last chunk through edge compute -> uplink -> propagation -> cloud compute."""
    edge_done = up_done = cloud_done = 0.0
    for c in chunks:
        edge_done += c * edge_tok
        up_done = max(edge_done, up_done) + c * up_tok_s + up_msg_s
        cloud_done = max(up_done + one_way, cloud_done) + c * cloud_tok
    return cloud_done


def _ctx_time(table: dict, ctx: int) -> float:
    """Per-layer decode time at ``ctx``: the nearest measured context (attention grows slowly with it)."""
    keys = sorted(table)
    return table[min(keys, key=lambda k: abs(k - ctx))]


def predict(costs: Costs, cfg: PlanConfig, n: int | str, shape: Shape) -> dict:
    """Predicted TTFT and per-token latency (seconds) of one request shape at split ``n`` (an int), or of
    ``"all-cloud"`` / ``"all-edge"``."""
    link, L = cfg.link, costs.num_layers
    ow = link.one_way_s
    ctx = shape.prompt_tokens + shape.output_tokens // 2
    mode = "split" if isinstance(n, int) else n
    over_ttft, over_tok = cfg.overheads.get(mode, (cfg.overhead_ms / 1000.0, cfg.overhead_ms / 1000.0))
    chunks = [min(cfg.prefill_chunk, shape.uncached - i) for i in range(0, shape.uncached, cfg.prefill_chunk)]
    cloud_dec = _ctx_time(costs.cloud["decode"], ctx)
    edge_dec = _ctx_time(costs.edge["decode"], ctx)
    if n == "all-edge":
        if costs.whole is not None:  # timed on the whole-model graph itself
            w = costs.whole
            return {"ttft_s": shape.uncached * w["prefill_per_token"] + _ctx_time(w["decode"], ctx),
                    "per_token_s": _ctx_time(w["decode"], ctx), "up_bytes": 0.0}
        ttft = shape.uncached * costs.edge["prefill_per_token"] * L + costs.head_edge_s
        return {"ttft_s": ttft, "per_token_s": edge_dec * L + costs.head_edge_s, "up_bytes": 0.0}
    if n == "all-cloud":
        up = shape.text_bytes + HTTP_REQUEST_OVERHEAD
        segs = math.ceil(up / MSS)
        ttft = (link.up_seconds(up) + ow + shape.uncached * costs.cloud["prefill_per_token"] * L
                + costs.cloud["head"] + ow + link.down_seconds(SSE_PER_TOKEN) + link.expected_extra_s(segs) + over_ttft)
        per_tok = max(cloud_dec * L + costs.cloud["head"] + over_tok, link.down_seconds(SSE_PER_TOKEN))
        return {"ttft_s": ttft, "per_token_s": per_tok + link.loss * link.rto_ms / 1000.0,
                "up_bytes": float(up)}
    b = costs.codec_bytes[n][cfg.codec]
    up_tok_s = link.up_seconds(b)
    up_msg_s = link.up_seconds(UP_MSG_OVERHEAD)
    ttft = (_pipeline(chunks, costs.edge["prefill_per_token"] * n, up_tok_s, up_msg_s,
                      costs.cloud["prefill_per_token"] * (L - n), ow)
            + costs.cloud["head"] + ow + link.down_seconds(DOWN_PER_TOKEN)
            + link.expected_extra_s(math.ceil(shape.uncached * b / MSS)) + over_ttft)
    per_tok = (edge_dec * n + link.up_seconds(b + UP_MSG_OVERHEAD) + cloud_dec * (L - n) + costs.cloud["head"]
               + 2 * ow + link.down_seconds(DOWN_PER_TOKEN) + link.expected_extra_s(math.ceil(b / MSS))
               + link.expected_extra_s(1) + over_tok)
    up_bytes = shape.uncached * b + len(chunks) * UP_MSG_OVERHEAD + (shape.output_tokens - 1) * (b + UP_MSG_OVERHEAD)
    return {"ttft_s": ttft, "per_token_s": per_tok, "up_bytes": up_bytes}


def edge_memory_mb(costs: Costs, n: int, cfg: PlanConfig) -> float:
    ctx = cfg.agent.prompt_tokens + cfg.agent.output_tokens
    weights = costs.embed_weight_bytes + n * costs.layer_weight_bytes
    kv = n * ctx * costs.kv_bytes_per_token_layer
    cached = cfg.agent.cached_tokens * (n * costs.kv_bytes_per_token_layer + 4 * costs.hidden_size)
    return (weights + kv + cached) / 2**20


def _phone_memory_mb(costs: Costs, n: int | str, cfg: PlanConfig) -> float:
    """Phone memory of split ``n``; all-edge adds the lm_head (an int8 vocab x hidden table); all-cloud: 0."""
    if n == "all-cloud":
        return 0.0
    if n == "all-edge":
        return edge_memory_mb(costs, costs.num_layers, cfg) + costs.embed_weight_bytes / 2**20
    return edge_memory_mb(costs, n, cfg)


def default_candidates(num_layers: int) -> list[int]:
    picks = {1, 2, 4, 8, 12, 16, 24, num_layers // 2, num_layers - 1}
    return sorted(n for n in picks if 1 <= n < num_layers)


def check_candidates(cfg: PlanConfig, num_layers: int) -> None:
    """``--candidates`` fit a model of ``num_layers`` layers: PlanError otherwise (the CLI checks them from the
    config or GGUF metadata before the weights load, measure_costs again on the loaded model)."""
    L = num_layers
    if cfg.candidates and max(cfg.candidates) >= L:
        raise PlanError(f"--candidates {max(cfg.candidates)}: the model has {L} layers (split layers 1 to {L - 1})")


def measure_costs(lm: LoadedModel, cfg: PlanConfig, bundle: Path | None = None) -> Costs:
    adapter = ModelAdapter(lm.model)
    L = adapter.num_layers
    check_candidates(cfg, L)
    if bundle is not None:  # its front's per-layer costs stand for this model's layers
        from shared.manifest import Manifest, same_source

        m = Manifest.load(bundle)
        if not same_source(m.source_identity, lm.identity):
            raise PlanError(f"--bundle {bundle}: split from another model ({m.source_identity}, not {lm.identity}); "
                            "its front's timings are not this model's")
    contexts = sorted({cfg.chat.prompt_tokens + cfg.chat.output_tokens // 2,
                       cfg.agent.prompt_tokens + cfg.agent.output_tokens // 2})
    started = time.perf_counter()
    steps = Steps(3 + (bundle is None) + (cfg.whole is not None), "plan")
    with tempfile.TemporaryDirectory() as tmp, _Pinned(cfg.edge_cores):
        if bundle is None:
            steps.next(f"split a probe bundle at {min(cfg.probe_layers, L - 1)} (int8) to time its front")
        timed = Path(bundle) if bundle is not None else _probe_bundle(lm, min(cfg.probe_layers, L - 1), Path(tmp))
        steps.next(f"time the edge front ({cfg.edge_threads} thread(s))")
        edge = edge_layer_times(timed, cfg.edge_threads, cfg.prefill_chunk, contexts)
        edge["front"] = str(timed) if bundle is not None else f"probe bundle split at {cfg.probe_layers} (int8)"
        if cfg.whole is not None:
            steps.next("time the whole-model graph (all-edge)")
        whole = (whole_model_times(cfg.whole, cfg.edge_threads, cfg.prefill_chunk, contexts)
                 if cfg.whole is not None else None)
    steps.next("read the GPU cloud costs" if cfg.cloud_results is not None else
               f"time a cloud layer in torch ({cfg.cloud_threads} thread(s))")
    with _Pinned(cfg.cloud_cores):
        cloud = (cloud_gpu_times(cfg.cloud_results, adapter, contexts) if cfg.cloud_results is not None
                 else cloud_layer_times(adapter, cfg.cloud_threads, cfg.prefill_chunk, contexts))
    layer_params = sum(p.numel() for p in adapter.layers[0].parameters())
    cands = cfg.candidates or default_candidates(L)
    head_params = adapter.lm_head.weight.numel()
    decode_ref = _ctx_time(edge["decode"], contexts[-1])
    steps.next(f"boundary bytes per token of each codec at N = {', '.join(map(str, sorted(set(cands))))}")
    codec_bytes = codec_bytes_per_token(lm, adapter, sorted(set(cands)))
    steps.done(time.perf_counter() - started)
    return Costs(
        num_layers=L, edge=edge, cloud=cloud,
        codec_bytes=codec_bytes,
        layer_weight_bytes=layer_params * (1 + 4 / 32),  # int8 + an fp32 scale per block of 32
        embed_weight_bytes=adapter.vocab_size * adapter.hidden_size * (1 + 4 / 32),
        head_edge_s=decode_ref * head_params / layer_params,  # memory-bound: time scales with weight bytes
        kv_bytes_per_token_layer=2 * adapter.num_kv_heads * adapter.head_dim * 4,
        hidden_size=adapter.hidden_size, whole=whole,
    )


def plan(lm: LoadedModel, cfg: PlanConfig, bundle: Path | None = None) -> dict:
    """Measure, predict every candidate N and the two baselines, pick N. Returns a JSON-able dict."""
    costs = measure_costs(lm, cfg, bundle)
    L = costs.num_layers
    rows = []
    for n in [*(cfg.candidates or default_candidates(L)), "all-cloud", "all-edge"]:
        chat, agent = predict(costs, cfg, n, cfg.chat), predict(costs, cfg, n, cfg.agent)
        mem = _phone_memory_mb(costs, n, cfg)
        rows.append({
            "n": n, "chat_ttft_ms": 1000 * chat["ttft_s"], "chat_per_token_ms": 1000 * chat["per_token_s"],
            "agent_ttft_ms": 1000 * agent["ttft_s"], "agent_per_token_ms": 1000 * agent["per_token_s"],
            "agent_step_ms": 1000 * (agent["ttft_s"] + (cfg.agent.output_tokens - 1) * agent["per_token_s"]),
            "edge_memory_mb": mem, "chat_upload_bytes": chat["up_bytes"], "agent_upload_bytes": agent["up_bytes"],
            "fits": mem <= cfg.edge_memory_mb, "recovered_fraction": _exposure(lm, cfg, n),
        })
    splits = [r for r in rows if isinstance(r["n"], int) and r["fits"]]
    pick = min(splits, key=lambda r: r["agent_step_ms"])["n"] if splits else None
    return {"link": cfg.link.to_dict(), "edge_threads": cfg.edge_threads, "codec": cfg.codec,
            "overhead_ms": cfg.overhead_ms, "edge_memory_budget_mb": cfg.edge_memory_mb, "costs": _costs_dict(costs), "rows": rows, "pick": pick,
            "chat": _shape_dict(cfg.chat), "agent": _shape_dict(cfg.agent)}


def _exposure(lm: LoadedModel, cfg: PlanConfig, n) -> float | None:
    """The fraction of prompt tokens the cloud can read: measured inversion figures for a split
    (``partition_tools.privacy``; ``None`` where unmeasured), all of them for all-cloud, none for all-edge."""
    if n == "all-cloud":
        return 1.0
    if n == "all-edge":
        return 0.0
    return recovered_fraction(n, cfg.codec, model=lm.identity)


def _shape_dict(shape: Shape) -> dict:
    return {"prompt_tokens": shape.prompt_tokens, "cached_tokens": shape.cached_tokens,
            "output_tokens": shape.output_tokens, "text_bytes": shape.text_bytes}


def _costs_dict(c: Costs) -> dict:
    ms = {"edge_prefill_ms_per_token_layer": 1000 * c.edge["prefill_per_token"],
          "edge_decode_ms_per_layer": {str(k): 1000 * v for k, v in c.edge["decode"].items()},
          "cloud_prefill_ms_per_token_layer": 1000 * c.cloud["prefill_per_token"],
          "cloud_decode_ms_per_layer": {str(k): 1000 * v for k, v in c.cloud["decode"].items()},
          "cloud_head_ms": 1000 * c.cloud["head"], "edge_head_ms": 1000 * c.head_edge_s,
          "whole_model": None if c.whole is None else {
              "prefill_ms_per_token": 1000 * c.whole["prefill_per_token"],
              "decode_ms": {str(k): 1000 * v for k, v in c.whole["decode"].items()}},
          "edge_front_timed": c.edge.get("front"), "cloud_source": c.cloud.get("source", "torch on this CPU"),
          "codec_bytes_per_token": {str(k): v for k, v in c.codec_bytes.items()}, "num_layers": c.num_layers}
    return ms


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def format_plan(result: dict) -> str:
    c = result["costs"]
    link = result["link"]
    lines = [
        f"link {link['name']}: RTT {link['rtt_ms']:g} ms, {link['up_mbps']:g} Mbps up / {link['down_mbps']:g} down, "
        f"loss {100 * link['loss']:g} %; edge {result['edge_threads']} thread(s); wire codec {result['codec']}",
        f"edge per layer: prefill {c['edge_prefill_ms_per_token_layer']:.3f} ms/token, decode "
        + ", ".join(f"{v:.2f} ms @{k}" for k, v in c["edge_decode_ms_per_layer"].items())
        + f" ({c['edge_front_timed']})",
        f"cloud per layer: prefill {c['cloud_prefill_ms_per_token_layer']:.3f} ms/token, decode "
        + ", ".join(f"{v:.2f} ms @{k}" for k, v in c["cloud_decode_ms_per_layer"].items())
        + f", head {c['cloud_head_ms']:.2f} ms ({c['cloud_source']})",
        f"chat: {result['chat']['prompt_tokens']} prompt -> {result['chat']['output_tokens']} tokens; agent step: "
        f"{result['agent']['prompt_tokens']} prompt ({result['agent']['cached_tokens']} cached) -> "
        f"{result['agent']['output_tokens']} tokens",
        "",
        f"{'N':>9} {'chat TTFT':>10} {'chat/tok':>9} {'agent TTFT':>11} {'agent/tok':>10} {'agent step':>11} "
        f"{'edge MB':>8} {'up chat':>9} {'up agent':>9} {'recovered':>9}",
    ]
    for r in result["rows"]:
        mark = " <- pick" if r["n"] == result["pick"] else ("" if r["fits"] else " (over memory)")
        lines.append(f"{r['n']!s:>9} {r['chat_ttft_ms']:>8.0f}ms {r['chat_per_token_ms']:>7.1f}ms "
                     f"{r['agent_ttft_ms']:>9.0f}ms {r['agent_per_token_ms']:>8.1f}ms {r['agent_step_ms']:>9.0f}ms "
                     f"{r['edge_memory_mb']:>8.1f} {r['chat_upload_bytes'] / 1024:>8.1f}K "
                     f"{r['agent_upload_bytes'] / 1024:>8.1f}K {_pct(r['recovered_fraction']):>9}{mark}")
    if result["pick"] is not None:
        lines.append(f"pick: N = {result['pick']} (fastest agent step within the edge memory budget)")
    else:  # it said 'pick: N = None'
        least = min((r for r in result["rows"] if isinstance(r["n"], int)), key=lambda r: r["edge_memory_mb"])
        lines.append(f"pick: none - no split fits the edge memory budget of {result['edge_memory_budget_mb']:g} MB "
                     f"(N = {least['n']} needs {least['edge_memory_mb']:.1f} MB; --edge-memory-mb)")
    lines.append("recovered: prompt tokens an inversion attack recovered from the boundary states "
                 "(docs/security.md; '-' where unmeasured for this model and codec)")
    return "\n".join(lines)
