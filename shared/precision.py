"""Precision per request: which codec carries the boundary on the wire, which variant computes the back half.

``choose_precision(features, override)`` is a pure function of the request (prompt length, images, audio), the
client's link hint and the server's load; both ends can run it (the edge to pick the codec it encodes with,
the server to pick its compute variant and to report the plan in ``Welcome`` / ``Tokens``).

The default policy keeps the articles' shape - cheaper precision for short text, full precision for long
prompts and images - but every tier rests on the numbers in docs/quality.md (SmolLM2-135M, fp32 edge,
``bench/codec_bench.py --compute``), not on the articles:

* wire: ``int8-outlier`` is near-lossless (top-1 >= 0.996, KL <= 1e-4 at split layers 4/8/16) at ~1.02 bytes
  per element, half of fp16, so it is the default whenever the bundle carries calibration. ``int4-outlier``
  (~0.59 bytes/element, top-1 ~0.98, KL ~0.002-0.003) is used only when the uplink would make the upload slow.
  Multimodal requests use the calibration-free ``int8-b32``: image and audio tokens were not in the text
  calibration, and per-32-channel scales confine an unforeseen outlier channel to its own block.
* small text prompts travel lossless: when a text prompt's fp16 states fit in ``lossless_prompt_kib`` (64 KiB:
  56 tokens at SmolLM2's H = 576, 8 at GLM's 4096), ``fp16`` carries them, for at most 32 KiB more upload than
  ``int8-outlier`` (~26 ms at 10 Mbit/s). With an edge that computes the fp32 front's function, the
  near-lossless codec's prompt rows were what still flipped answers (docs/quality.md, "Edge answers").
* per message type: the plan's codec carries the prompt chunks (bulk, and the codec the prefix keys name);
  decode steps and SpecSteps (a row or a few, latency-bound) travel in ``step_codecs`` (fp16) when both ends
  have it (:func:`step_codec`), for ~1 byte per element more on messages of one row (what it buys:
  docs/quality.md, "Edge answers").
* compute: fp16 is near-lossless (KL ~2e-5 at every measured prompt position, 0-1023) and is the default for
  text up to ``long_prompt_tokens`` = 1024, the longest context measured. bf16 is *lossier* on the same
  numbers (KL ~1e-3, flat over positions), so it is not chosen for quality: it is the safe choice where
  fp16's range was not measured - longer contexts, images and audio. Weight-only int8 costs the most (top-1
  -1.5 %, KL ~2e-3, and no less on short prompts: positions 0-127 are the most sensitive), so it is used only
  for short text prompts *and* only when the server is busy: short requests are decode-bound, where
  weight-only int8 gains most - a throughput lever with a measured price, not a free lunch. It is taken only
  from requests that leave their whole precision to the policy: one that pins any of it (a codec too:
  ``precision={"codec": "fp32"}``, ``EdgeConfig.codec``, a bare ``"fp16"`` on a server without that compute)
  asked for its answer's precision, and the server's load never moves it to int8.

References: docs/quality.md ("Boundary codecs", "Compute variants"); the articles' rule (int8 < 128 tokens,
fp16 up to 512, bf16 beyond or with images), of which the 512 moved to 1024 and int8 became load-gated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .codecs import CALIBRATED_CODECS, CODEC_NAMES
from .plan import COMPUTE_VARIANTS, PrecisionPlan

__all__ = [
    "COMPUTE_VARIANTS",
    "DEFAULT_POLICY",
    "PrecisionError",
    "PrecisionOverride",
    "PrecisionPlan",
    "PrecisionPolicy",
    "RequestFeatures",
    "choose_precision",
    "step_codec",
]

CALIBRATION_FREE_CODECS = tuple(c for c in CODEC_NAMES if c not in CALIBRATED_CODECS)


class PrecisionError(ValueError):
    """A client override asks for a codec or compute variant this deployment does not offer."""


@dataclass(slots=True)
class RequestFeatures:
    prompt_tokens: int  # tokens whose hidden states the edge uploads (prompt length)
    images: int = 0  # images in the request
    audio: int = 0  # audio clips in the request
    link_kbps: float | None = None  # client's uplink hint (ClientHints.link_kbps); None = unknown
    server_load: float = 0.0  # busy fraction of the server in [0, 1] (ServerInfo.load)
    hidden_size: int = 4096  # H of the boundary (the bundle's), for upload-time estimates

    def __post_init__(self):
        if self.prompt_tokens < 0 or self.images < 0 or self.audio < 0:
            raise ValueError("prompt_tokens, images and audio must be >= 0")
        if self.link_kbps is not None and not (math.isfinite(self.link_kbps) and self.link_kbps > 0):
            raise ValueError(f"link_kbps must be a positive number, got {self.link_kbps}")
        if not 0.0 <= self.server_load <= 1.0:
            raise ValueError(f"server_load must be in [0, 1], got {self.server_load}")
        if self.hidden_size < 1:
            raise ValueError(f"hidden_size must be >= 1, got {self.hidden_size}")

    @property
    def multimodal(self) -> bool:
        return self.images > 0 or self.audio > 0


@dataclass(slots=True)
class PrecisionOverride:
    """A client's explicit choice; either part may be left to the policy."""

    codec: str | None = None
    compute: str | None = None

    def __post_init__(self):
        if self.codec is not None and self.codec not in CODEC_NAMES:
            raise PrecisionError(f"codec {self.codec!r}: expected one of {', '.join(CODEC_NAMES)}")
        if self.compute is not None and self.compute not in COMPUTE_VARIANTS:
            raise PrecisionError(f"compute {self.compute!r}: expected one of {', '.join(COMPUTE_VARIANTS)}")

    @classmethod
    def parse(cls, value: PrecisionOverride | PrecisionPlan | dict | str | None) -> PrecisionOverride | None:
        """Accept what clients send: a name ("int8-outlier" -> codec, "int8" -> compute, "fp16"/"bf16" ->
        both), a dict with "codec"/"compute", a plan, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, PrecisionPlan):
            return cls(codec=value.codec, compute=value.compute)
        if isinstance(value, dict):
            unknown = set(value) - {"codec", "compute"}
            if unknown:
                raise PrecisionError(f"precision override: unknown keys {sorted(unknown)}")
            return cls(codec=value.get("codec"), compute=value.get("compute"))
        if isinstance(value, str):
            is_codec, is_compute = value in CODEC_NAMES, value in COMPUTE_VARIANTS
            if not (is_codec or is_compute):
                raise PrecisionError(f"precision {value!r}: expected a codec ({', '.join(CODEC_NAMES)}) or a "
                                     f"compute variant ({', '.join(COMPUTE_VARIANTS)})")
            return cls(codec=value if is_codec else None, compute=value if is_compute else None)
        raise PrecisionError(f"precision override of type {type(value).__name__}")

    @classmethod
    def for_server(cls, value: PrecisionOverride | PrecisionPlan | dict | str | None,
                   compute_variants) -> PrecisionOverride | None:
        """:meth:`parse` on a server that computes in ``compute_variants``: a bare name of both ("fp16", "bf16",
        "fp32") names the codec only where that server computes otherwise; an explicit {"codec": ..., "compute":
        ...} is held to both. The edge's split requests and the cloud's full-model requests (the OpenAI
        ``precision`` field) alike: a full-mode "bf16" on a CPU server was a 400 where the edge ran it."""
        override = cls.parse(value)
        if (isinstance(value, str) and override.codec is not None and override.compute is not None
                and override.compute not in compute_variants):
            override = cls(codec=override.codec)
        return override


@dataclass(slots=True)
class PrecisionPolicy:
    short_prompt_tokens: int = 128  # below: int8 compute may be used under load (the articles' int8 tier)
    long_prompt_tokens: int = 1024  # above: bf16 (fp16 measured near-lossless up to 1024; the articles say 512)
    int8_min_load: float = 0.75  # int8 costs top-1 -1.5 % / KL 2e-3 (docs/quality.md): only when this busy
    upload_budget_ms: float = 1500.0  # near-lossless upload slower than this on the hinted link -> compact codec
    lossless_prompt_kib: float = 64.0  # a text prompt whose fp16 states fit in this travels in lossless_codecs
    lossless_codecs: tuple[str, ...] = ("fp16",)  # first available wins; () turns the small-prompt rule off
    near_lossless_codecs: tuple[str, ...] = ("int8-outlier", "int8-b32", "fp16", "bf16")  # first available wins
    compact_codec: str = "int4-outlier"
    multimodal_codecs: tuple[str, ...] = ("int8-b32", "fp16", "bf16")  # calibration-free first
    # decode-step and SpecStep states (one row or a few per message, latency-bound): first available wins;
    # () sends them in the prompt's codec
    step_codecs: tuple[str, ...] = ("fp16",)

    def __post_init__(self):
        if not 0 <= self.short_prompt_tokens <= self.long_prompt_tokens:
            raise ValueError("need 0 <= short_prompt_tokens <= long_prompt_tokens")
        if not 0.0 <= self.int8_min_load <= 1.0:
            raise ValueError("int8_min_load must be in [0, 1]")
        if not self.upload_budget_ms > 0:
            raise ValueError("upload_budget_ms must be > 0")
        if not (math.isfinite(self.lossless_prompt_kib) and self.lossless_prompt_kib >= 0):
            raise ValueError("lossless_prompt_kib must be a finite number >= 0")
        for name in (*self.near_lossless_codecs, self.compact_codec, *self.multimodal_codecs, *self.step_codecs,
                     *self.lossless_codecs):
            if name not in CODEC_NAMES:
                raise ValueError(f"unknown codec {name!r} in the policy")


DEFAULT_POLICY = PrecisionPolicy()
NOMINAL_BYTES_PER_ELEMENT = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8-b32": 1.0625, "int8-b64": 1.031, "int4-b32": 0.5625,
                             "int8-outlier": 1.02, "int4-outlier": 0.59,
                             "pca-fine": 0.75, "pca-compact": 0.29, "pca-ans-compact": 0.31,
                             "pca-tcq-compact": 0.3}  # for upload-time estimates only; every codec has one (a test)


def upload_ms(features: RequestFeatures, codec: str) -> float | None:
    """Estimated time to upload the prompt's hidden states with ``codec`` on the hinted link (None: no hint)."""
    if features.link_kbps is None:
        return None
    bits = features.prompt_tokens * features.hidden_size * NOMINAL_BYTES_PER_ELEMENT[codec] * 8
    return bits / features.link_kbps  # kbit/s == bit/ms


def _first(prefs, available) -> str | None:
    return next((c for c in prefs if c in available), None)


def choose_precision(features: RequestFeatures, override=None, available_codecs=CALIBRATION_FREE_CODECS,
                     available_compute=COMPUTE_VARIANTS, policy: PrecisionPolicy = DEFAULT_POLICY) -> PrecisionPlan:
    """The plan for one request (see the module docstring for the rules and their evidence).

    ``available_codecs``: codecs both ends can use (the calibrated ones only when the bundle has calibration;
    the default is the calibration-free set). ``available_compute``: the server's variants.
    ``override``: see :meth:`PrecisionOverride.parse`; an unavailable choice raises :class:`PrecisionError`.
    """
    available_codecs, available_compute = tuple(available_codecs), tuple(available_compute)
    if not available_codecs or not available_compute:
        raise PrecisionError("no codec or no compute variant available")
    ov = PrecisionOverride.parse(override)
    if ov is not None and ov.codec is not None and ov.codec not in available_codecs:
        raise PrecisionError(f"codec {ov.codec!r} is not available here (available: {', '.join(available_codecs)})")
    if ov is not None and ov.compute is not None and ov.compute not in available_compute:
        raise PrecisionError(f"compute {ov.compute!r} is not available here "
                             f"(available: {', '.join(available_compute)})")
    f, p = features, policy

    # 1. wire codec
    if ov is not None and ov.codec is not None:
        codec, why_codec = ov.codec, "client override"
    elif f.multimodal:
        codec = _first(p.multimodal_codecs, available_codecs) or available_codecs[0]
        why_codec = "multimodal: calibration-free codec"
    elif (f.prompt_tokens and f.prompt_tokens * f.hidden_size * 2 <= p.lossless_prompt_kib * 1024
          and (lossless := _first(p.lossless_codecs, available_codecs))):
        codec = lossless
        why_codec = f"small prompt ({f.prompt_tokens * f.hidden_size * 2 / 1024:.0f} KiB fp16): lossless"
    else:
        codec = _first(p.near_lossless_codecs, available_codecs) or available_codecs[0]
        why_codec = "near-lossless codec"
        t = upload_ms(f, codec)
        if t is not None and t > p.upload_budget_ms and p.compact_codec in available_codecs:
            codec, why_codec = p.compact_codec, f"slow link: {t:.0f} ms upload > {p.upload_budget_ms:.0f} ms"

    # 2. compute variant
    if ov is not None and ov.compute is not None:
        compute, why_compute = ov.compute, "client override"
    elif f.multimodal or f.prompt_tokens > p.long_prompt_tokens:
        compute = _first(("bf16", "fp32", "fp16"), available_compute)
        why_compute = "multimodal" if f.multimodal else f"long prompt (> {p.long_prompt_tokens})"
    elif ((ov is None or ov.codec is None) and f.prompt_tokens < p.short_prompt_tokens  # load moves only a
          and f.server_load >= p.int8_min_load and "int8" in available_compute):  # request that pinned nothing
        compute, why_compute = "int8", f"short prompt under load {f.server_load:.2f}"
    else:
        compute = _first(("fp16", "bf16", "fp32"), available_compute)
        why_compute = "default"
    compute = compute or available_compute[0]
    plan = PrecisionPlan(codec=codec, compute=compute, reason=f"{why_codec}; {why_compute}")
    steps = step_codec(plan, ov, available_codecs, policy)
    if steps != codec:
        plan.reason += f"; steps {steps}"
    plan.reason = plan.reason[:200]
    return plan


def step_codec(plan: PrecisionPlan, override=None, available_codecs=CALIBRATION_FREE_CODECS,
               policy: PrecisionPolicy = DEFAULT_POLICY) -> str:
    """The codec of a request's decode-step and SpecStep states under ``plan``, whose ``codec`` carries the
    prompt chunks (and is the one the prefix keys name: only prompt blocks are keyed).

    A decode step is one row of H values on a latency-bound message, a prompt is bulk: the policy's
    ``step_codecs`` (fp16) keep the steps lossless where both ends have them, at ~1 byte per element more
    (docs/quality.md, "Edge answers"). A client override of the codec pins every message; a plan on the
    compact codec (a slow link) keeps it on the steps too. Both ends compute it from the plan and the
    negotiated codecs, and the cloud decodes each message by the codec it names.
    """
    ov = PrecisionOverride.parse(override)
    if ov is not None and ov.codec is not None:
        return ov.codec
    if plan.codec == policy.compact_codec:
        return plan.codec
    return _first(policy.step_codecs, tuple(available_codecs)) or plan.codec
