"""The all-edge baseline on the simulated phone: the whole model in onnxruntime, greedy decoding, no network.

Runs the graph ``partition_tools.export_whole`` writes (same quantization recipe as the edge front). Like
the split edge it keeps the KV cache of its last request and reuses the longest common token prefix (an
agent's system prompt is computed once), so the comparison with the split's activation cache is fair. A request fits the context as the split's does
(``edge_client.request.fit_answer``): a prompt of the export's ``max_positions`` or more is refused, and
``max_tokens`` is cut to the positions left (the answer then ends ``"length"`` there).

Only numpy and onnxruntime: this is phone-side code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edge_client.request import answer_end, fit_answer, mark_token
from shared.whole_model import WHOLE_GRAPH, read_meta


@dataclass(slots=True)
class EdgeRun:
    token_ids: list[int]
    ttft_s: float
    itl_s: list[float] = field(default_factory=list)
    total_s: float = 0.0
    compute_s: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose KV the previous request left in the cache
    finish_reason: str = "stop"  # "length": max_tokens (cut to the context) ended it (edge_client.request.answer_end)


class WholeModelRunner:
    """One sequence at a time over ``model.onnx``; ``generate(ids, max_tokens)`` is greedy."""

    def __init__(self, whole_dir: str | Path, threads: int = 2, chunk: int = 128):
        whole_dir = Path(whole_dir)
        self.meta = read_meta(whole_dir)
        self.n_layers = int(self.meta["num_layers"])
        self.kv_heads = int(self.meta["num_kv_heads"])
        self.head_dim = int(self.meta["head_dim"])
        self.eos = set(int(t) for t in self.meta["eos_token_ids"])
        self.max_positions = int(self.meta["max_positions"])  # prompt + answer
        self.chunk = chunk
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(str(whole_dir / WHOLE_GRAPH), sess_options=opts,
                                            providers=["CPUExecutionProvider"])
        self.outputs = ["logits"] + [f"present_{kv}.{i}" for i in range(self.n_layers) for kv in ("key", "value")]
        self.ids: list[int] = []  # tokens whose KV the cache holds
        self.kv: list[np.ndarray] = []
        self._truncate(0)

    def _truncate(self, n: int) -> None:
        if n == 0 or not self.kv:
            empty = np.zeros((1, self.kv_heads, 0, self.head_dim), dtype=np.float32)  # [1, KVH, 0, D]
            self.kv = [empty] * (2 * self.n_layers)
        else:
            self.kv = [np.ascontiguousarray(t[:, :, :n]) for t in self.kv]  # [1, KVH, n, D]
        self.ids = self.ids[:n]

    def _forward(self, ids: list[int]) -> np.ndarray:
        p = len(self.ids)
        feeds = {"input_ids": np.asarray(ids, dtype=np.int64)[None],  # [1, S]
                 "position_ids": np.arange(p, p + len(ids), dtype=np.int64)[None]}
        for i in range(self.n_layers):
            feeds[f"past_key.{i}"] = self.kv[2 * i]  # [1, KVH, P, D]
            feeds[f"past_value.{i}"] = self.kv[2 * i + 1]
        out = self.session.run(self.outputs, feeds)
        self.kv = out[1:]  # [1, KVH, P+S, D]
        self.ids += list(ids)
        return out[0][0]  # [V] logits of the last position

    def generate(self, prompt_ids: list[int], max_tokens: int) -> EdgeRun:
        """Greedy continuation of ``prompt_ids``; stops at an eos token (returned and counted, as the split's
        answer counts it: ``edge_client.request.answer_end``) or ``max_tokens``, cut to the context left
        (EdgeClientError ``context_full`` for a prompt that leaves no room)."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        max_tokens = fit_answer(len(prompt_ids), max_tokens, (self.max_positions - 1, f"the whole graph's "
                                f"{self.max_positions} positions less one for the answer"), self.max_positions)
        t0 = time.perf_counter()
        common = 0
        for a, b in zip(self.ids, prompt_ids[:-1]):  # keep at least one token to run: its logits start decoding
            if a != b:
                break
            common += 1
        self._truncate(common)
        compute = 0.0
        rest = prompt_ids[common:]
        for i in range(0, len(rest), self.chunk):
            c0 = time.perf_counter()
            logits = self._forward(rest[i:i + self.chunk])
            compute += time.perf_counter() - c0
        tokens: list[int] = []
        run = EdgeRun(tokens, ttft_s=0.0, cached_tokens=common)
        last = None
        while len(tokens) < max_tokens:
            token = int(np.argmax(logits))
            last = mark_token(run, t0, last)
            tokens.append(token)
            _, finish = answer_end(len(tokens) - 1, [token], max_tokens, self.eos)
            if finish is not None:
                run.finish_reason = finish
                break
            c0 = time.perf_counter()
            logits = self._forward([token])
            compute += time.perf_counter() - c0
        run.total_s = time.perf_counter() - t0
        run.compute_s = compute
        if not tokens:
            run.ttft_s = run.total_s
        return run
