"""One simulated phone: a separate process that runs one job and reports each request as a JSON line.

    python -m rig.phone < job.json          (the rig starts it; stdout is the report channel)

The job (a JSON object): ``phone`` (index), ``mode`` (split | all-cloud | all-edge), ``bundle`` (split
bundle: its edge half and tokenizer), ``whole`` (all-edge: the whole-model export dir), ``url`` (split:
``ws://.../v1/split``; all-cloud: ``http://host:port``; both through this phone's emulated link),
``threads`` (onnxruntime intra-op threads), ``link_kbps`` (the link's uplink, split: the edge client is told it as an
app is, ``EdgeConfig.link_kbps``), ``cores`` (CPU ids to pin to, or null), ``requests``
(``rig.workloads.Request.to_dict()`` items), ``stream_first`` (emit the first answer's text deltas).

Out, one JSON object per line: ``{"event": "ready", "setup_s": ...}`` (then it waits for a ``go`` line on
stdin), then per request ``{"event":
"delta", "text": ...}`` (``stream_first`` only) and ``{"event": "request", ...record...}``, then ``{"event":
"done"}``; ``{"event": "error", "message": ...}`` on failure. Phone-side only: no torch is imported.

Before the measured requests each phone sends one short warm-up request (not reported): onnxruntime's first
run allocates, the server's first step compiles; a real phone's app has long done both.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time

WARMUP = [{"role": "user", "content": "Hi"}]


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _ready(t0: float) -> None:
    """Report the warm-up done, then wait for the rig's go (every phone of a burst starts together)."""
    _emit({"event": "ready", "setup_s": time.perf_counter() - t0})
    if sys.stdin.readline().strip() != "go":
        raise RuntimeError("the rig closed the job before its start signal")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _record(job: dict, req: dict, **fields) -> dict:
    rec = {"event": "request", "phone": job["phone"], "mode": job["mode"], "label": req["label"]}
    rec.update(fields)
    n = rec["completion_tokens"]
    gaps = rec["itl_s"]
    rec["tokens_per_s"] = len(gaps) / sum(gaps) if gaps and sum(gaps) > 0 else 0.0
    rec["text_sha256"] = _digest(rec["text"])
    rec["bytes_per_token_up"] = rec["bytes_up"] / max(1, rec["prompt_tokens"] + n)
    rec["bytes_per_token_down"] = rec["bytes_down"] / max(1, n)
    return rec


def run_split(job: dict) -> None:
    from edge_client.client import EdgeClient

    t0 = time.perf_counter()
    with EdgeClient(job["bundle"], job["url"], threads=job["threads"], link_kbps=job["link_kbps"]) as client:
        client.connect()
        client.complete(messages=WARMUP, max_tokens=2)
        _ready(t0)
        for i, req in enumerate(job["requests"]):
            gen = client.generate(messages=req["messages"], max_tokens=req["max_tokens"], temperature=0.0,
                                  speculate=job["speculate"])
            for delta in gen:
                if job.get("stream_first") and i == 0:
                    _emit({"event": "delta", "text": delta})
            st = gen.stats
            _emit(_record(job, req, prompt_tokens=st.prompt_tokens, completion_tokens=st.completion_tokens,
                          ttft_s=st.ttft_s or st.total_s, itl_s=list(st.itl_s), total_s=st.total_s,
                          bytes_up=st.bytes_up, bytes_down=st.bytes_down, edge_compute_s=st.edge_compute_s,
                          edge_cached_tokens=st.cached_tokens, cloud_cached_tokens=st.cloud_cached_tokens,
                          codec=st.codec, reconnects=st.reconnects, text=gen.text, token_ids=gen.token_ids,
                          finish_reason=gen.finish_reason, decode_round_trips=st.decode_round_trips,
                          draft_tokens=st.draft_tokens, accepted_draft_tokens=st.accepted_draft_tokens))


def run_all_cloud(job: dict) -> None:
    from .all_cloud import FullModelClient

    async def main():
        t0 = time.perf_counter()
        client = FullModelClient(job["url"])
        try:
            await client.chat(WARMUP, 2)
            _ready(t0)
            for i, req in enumerate(job["requests"]):
                def on_delta(text, first=(i == 0)):
                    if job.get("stream_first") and first:
                        _emit({"event": "delta", "text": text})
                r = await client.chat(req["messages"], req["max_tokens"], on_delta)
                _emit(_record(job, req, prompt_tokens=r.prompt_tokens, completion_tokens=r.completion_tokens,
                              ttft_s=r.ttft_s or r.total_s, itl_s=r.itl_s, total_s=r.total_s,
                              bytes_up=r.bytes_up, bytes_down=r.bytes_down, edge_compute_s=0.0,
                              edge_cached_tokens=0, cloud_cached_tokens=r.cached_tokens, codec="text",
                              reconnects=r.reconnects, text=r.text, token_ids=None, finish_reason=r.finish_reason))
        finally:
            await client.close()

    asyncio.run(main())


def run_all_edge(job: dict) -> None:
    from edge_client.tokenizer import EdgeTokenizer

    from .all_edge import WholeModelRunner

    t0 = time.perf_counter()
    tok = EdgeTokenizer.from_bundle(job["bundle"])
    runner = WholeModelRunner(job["whole"], threads=job["threads"])
    runner.generate(tok.chat_ids(WARMUP), 2)
    _ready(t0)
    for i, req in enumerate(job["requests"]):
        ids = tok.chat_ids(req["messages"])  # as the edge client tokenizes a chat; not timed: the split's TTFT
        # excludes it too
        r = runner.generate(ids, req["max_tokens"])
        text = tok.decode(r.token_ids)
        if job.get("stream_first") and i == 0:
            _emit({"event": "delta", "text": text})  # printed at the end: no network to wait on
        _emit(_record(job, req, prompt_tokens=len(ids), completion_tokens=len(r.token_ids),
                      ttft_s=r.ttft_s, itl_s=r.itl_s, total_s=r.total_s, bytes_up=0,
                      bytes_down=0, edge_compute_s=r.compute_s, edge_cached_tokens=r.cached_tokens,
                      cloud_cached_tokens=0, codec="none", reconnects=0, text=text, token_ids=r.token_ids,
                      finish_reason=r.finish_reason))


RUNNERS = {"split": run_split, "all-cloud": run_all_cloud, "all-edge": run_all_edge}


def main() -> int:
    job = json.loads(sys.stdin.readline())
    if job.get("cores"):
        os.sched_setaffinity(0, set(job["cores"]))
    try:
        RUNNERS[job["mode"]](job)
    except Exception as e:  # noqa: BLE001 - reported to the rig, which fails the run with it
        _emit({"event": "error", "message": f"{type(e).__name__}: {e}"})
        return 1
    _emit({"event": "done"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
