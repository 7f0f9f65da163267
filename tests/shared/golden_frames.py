"""Golden frames: one committed msgpack frame per message type, for a client written in another language.

``tests/shared/golden/<name>.bin`` holds the exact bytes our encoder produces for :data:`GOLDEN`'s message of
that name; ``tests/shared/golden/frames.json`` describes each (type code, message name, every field as JSON,
``bytes`` fields as hex, the frame's hex and SHA-256), so a Kotlin or Swift implementation can check both
directions: decode each ``.bin`` to the described fields, and encode the described fields to the same bytes.
``tests/shared/golden/codecs.json`` does the same for the calibration-free codecs' payloads: float32 input
rows (:data:`CODEC_ROWS`: rounding ties, an all-zero block, a short last block, a scale below float16's
smallest step, float16's largest value), the payload each codec's encoder writes for them, and what it decodes
to. ``tests/shared/test_golden_frames.py`` holds our encoder and decoder to them.

Regenerate (only for a deliberate wire change, which docs/protocol.md's Versioning rules govern)::

    python -m tests.shared.golden_frames --write
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from shared import codecs as C
from shared import protocol as P

GOLDEN_DIR = Path(__file__).with_name("golden")

_ROWS = np.array([[0.5, -1.0, 2.0, 0.0], [1.5, 0.25, -0.125, 3.0]], np.float32)  # [2, 4]
_ROW40 = (np.arange(40, dtype=np.float32) - 20) / 8  # [40]

_F16_STEP = float(np.float16(1 / 128))  # a float16 scale: 127 * it / 127 is exact, so codes x / scale tie below
CODEC_ROWS = np.zeros((3, 40), np.float32)  # [3, 40]: one full block of 32 and a short one of 8 (int8-b32)
CODEC_ROWS[0, :4] = [127 * _F16_STEP, 2.5 * _F16_STEP, 3.5 * _F16_STEP, -2.5 * _F16_STEP]  # int8 codes 2, 4, -2
CODEC_ROWS[0, 32:] = [0.1, -0.2, 0.3, 1 / 3, -1e-3, 0.0, 7.0, -7.0]  # scale 7/127 rounded up to float16
CODEC_ROWS[1, 32:] = [1e-8, -1e-8, 0, 0, 0, 0, 0, 2e-8]  # block 0 all zero; block 1's scale under float16's step
CODEC_ROWS[2, :6] = [1.00390625, 1.01171875, 65504.0, -65504.0, 6e-8, -3.0]  # bf16 ties to even, float16's max
CODEC_NAMES = ("fp32", "fp16", "bf16", "int8-b32", "int8-b64", "int4-b32")  # the codecs needing no calibration

GOLDEN: dict[str, P.Message] = {
    "hello": P.Hello(bundle_id="0123456789abcdef0123456789abcdef", codecs=["int8-outlier", "fp16"],
                     hints=P.ClientHints(link_kbps=20000.0, rtt_ms=35.5, device_class="phone-mid", edge_quant="int8",
                                         threads=2, client="golden/1"), resume_token=None),
    "welcome": P.Welcome(session_id="s-1", resume_token="tok-abc", resumed=True, limits=P.SessionLimits(),
                         plan=P.PrecisionPlan(codec="fp16", compute="bf16", reason="short prompt"),
                         codecs=["fp16"], server=P.ServerInfo(name="autoglm-cloud", version="1.0.0",
                                                              compute_variants=["bf16", "int8"], load=0.25,
                                                              max_draft_tokens=8),
                         cached_prefixes=["k0", "k1"],
                         requests=[P.RequestState(request_id="r1", received=703, tokens=4)]),
    "prefill": P.Prefill(request_id="r1", start=0, hidden=C.get_codec("fp16").encode(_ROWS), last=False,
                         params=P.SamplingParams(max_tokens=64, temperature=0.0, seed=7, stop_token_ids=[2]),
                         prefix_keys=["k0"], compute="bf16", rope_positions=None, prompt_len=703),
    "prefill_multimodal": P.Prefill(request_id="r2", start=0, hidden=C.get_codec("bf16").encode(_ROWS), last=True,
                                    params=P.SamplingParams(),
                                    rope_positions=P.WireArray.from_numpy(np.array([[0, 1], [0, 2], [0, 3]],
                                                                                   np.int32))),
    "decode_step": P.DecodeStep(request_id="r1", position=2, hidden=C.get_codec("int8-b32").encode(_ROW40[None]),
                                ask_drafts=3),
    "spec_step": P.SpecStep(request_id="r1", position=3, hidden=C.get_codec("fp16").encode(
        np.concatenate([_ROWS, _ROWS[::-1]])), draft_ids=[42, 7, 42]),
    "prefill_states": P.Prefill(request_id="r3", start=0, hidden=C.get_codec("fp16").encode(_ROWS), last=True,
                                params=P.SamplingParams(max_tokens=32), return_states=True),
    "states_step": P.StatesStep(request_id="r3", position=2, hidden=C.get_codec("fp16").encode(_ROWS)),
    "states": P.States(request_id="r3", start=0, hidden=C.get_codec("fp16").encode(_ROWS[::-1]),
                       timings=P.ServerTimings(total_ms=2.5), plan=P.PrecisionPlan(codec="fp16", compute="bf16")),
    "tokens_spec": P.Tokens(request_id="r1", index=1, token_ids=[42, 7, 13], timings=P.ServerTimings(total_ms=5.0)),
    "tokens_cloud_drafts": P.Tokens(request_id="r1", index=4, token_ids=[42], timings=P.ServerTimings(total_ms=5.0),
                                    draft_ids=[7, 13, 99]),
    "tokens": P.Tokens(request_id="r1", index=0, token_ids=[42], logprobs=[-0.5],
                       top_logprobs=[[P.TopLogprob(token_id=42, logprob=-0.5), P.TopLogprob(token_id=7, logprob=-1.25)]],
                       finish_reason=None, usage=None, timings=P.ServerTimings(queue_ms=0.5, compute_ms=3.0,
                                                                                total_ms=4.0),
                       plan=P.PrecisionPlan(codec="fp16", compute="bf16")),
    "tokens_progress": P.Tokens(request_id="r1", index=0, token_ids=[]),  # docs/protocol.md, "Progress"
    "tokens_final": P.Tokens(request_id="r1", index=5, token_ids=[2], finish_reason="stop",
                             usage=P.Usage(prompt_tokens=700, completion_tokens=6, cached_tokens=640), load=0.25),
    "cancel": P.Cancel(request_id="r1"),
    "resume": P.Resume(request_id="r1", have_tokens=3),
    "resumed": P.Resumed(request_id="r1", received=703, index=3, token_ids=[11, 12], finish_reason=None),
    "error": P.Error(code="overloaded", message="too many open requests", request_id="r9", fatal=False,
                     retry_after_ms=500),
    "drain": P.Drain(grace_ms=30000, reason="server shutting down"),
    "close": P.Close(reason="client closed"),
}


def _json(v):
    if dataclasses.is_dataclass(v):
        return {f.name: _json(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, (list, tuple)):
        return [_json(x) for x in v]
    if isinstance(v, bytes):
        return {"hex": v.hex()}
    return v


def describe(name: str, msg: P.Message) -> dict:
    """The JSON record of one golden frame."""
    frame = P.encode_message(msg)
    return {"file": f"{name}.bin", "type": msg.TYPE, "message": type(msg).__name__, "fields": _json(msg),
            "frame_hex": frame.hex(), "sha256": hashlib.sha256(frame).hexdigest(), "bytes": len(frame)}


def codec_vector(codec: str) -> dict:
    """The JSON record of ``codec``'s payload for :data:`CODEC_ROWS`."""
    c = C.get_codec(codec)
    payload = c.encode(CODEC_ROWS).data
    decoded = c.decode_payload(payload, *CODEC_ROWS.shape).astype("<f4")
    return {"codec": codec, "shape": list(CODEC_ROWS.shape), "input_f32le": CODEC_ROWS.astype("<f4").tobytes().hex(),
            "payload": payload.hex(), "decoded_f32le": decoded.tobytes().hex()}


def write(directory: Path = GOLDEN_DIR) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    records = []
    for name, msg in GOLDEN.items():
        (directory / f"{name}.bin").write_bytes(P.encode_message(msg))
        records.append(describe(name, msg))
    doc = {"protocol_version": P.PROTOCOL_VERSION, "spec": "docs/protocol.md", "frames": records}
    (directory / "frames.json").write_text(json.dumps(doc, indent=1) + "\n")
    vectors = {"spec": "docs/protocol.md#codec-payloads", "vectors": [codec_vector(c) for c in CODEC_NAMES]}
    (directory / "codecs.json").write_text(json.dumps(vectors, indent=1) + "\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="(re)write tests/shared/golden/")
    if ap.parse_args().write:
        write()
        print(f"wrote {len(GOLDEN)} frames to {GOLDEN_DIR}")
