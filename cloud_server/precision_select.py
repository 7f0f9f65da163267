"""Precision per request on the cloud: the shared policy (``shared.precision``) applied to this server.

The policy is a pure function of the request (prompt length, images), the client's link hint and the
server's load; the cloud runs it with what it actually offers: the codecs negotiated with the session and
the compute variants it loaded (``EngineFacts``, fixed at start: nothing here reads the running engine).
The load is the caller's figure: open requests over the engine's sequence capacity (:func:`load_fraction`).
It is applied at three points:

* :func:`session_plan` - the session's default plan, sent in ``Welcome.plan``;
* :func:`request_compute` - a split request's compute variant when its ``Prefill.compute`` is empty, for the
  length its first Prefill says (``Prefill.prompt_len``; docs/protocol.md, "Precision") (the first ``Tokens``
  reports the plan used);
* :func:`compute_variant` - a full-model request's variant, with the OpenAI ``precision`` override.

Decode steps and SpecSteps may travel in another negotiated codec than the prompt (``shared.precision.
step_codec``: fp16 by default; the plan's reason says "steps fp16"): the cloud decodes every message by the
codec it names, so nothing here has to agree beyond the negotiated set.

The load-dependent choice (int8 compute on a busy server for short prompts) is the one way a request's
answer can depend on other clients; a client that needs reproducible answers pins the compute variant
(``Prefill.compute``, the OpenAI ``precision`` field), which always wins over the policy.
"""

from __future__ import annotations

from cloud_server.engine_facts import EngineFacts
from shared.precision import (
    PrecisionError,
    PrecisionOverride,
    PrecisionPlan,
    RequestFeatures,
    choose_precision,
)


def load_fraction(open_requests: int, facts: EngineFacts) -> float:
    """Busy fraction in [0, 1]: ``open_requests`` over the engine's sequence capacity."""
    return min(1.0, open_requests / max(1, facts.max_num_seqs))


def _features(facts: EngineFacts, load: float, prompt_tokens: int, images: int = 0,
              link_kbps: float | None = None) -> RequestFeatures:
    return RequestFeatures(prompt_tokens=prompt_tokens, images=images, link_kbps=link_kbps, server_load=load,
                           hidden_size=facts.hidden_size)


def session_plan(hello, codecs: list[str], facts: EngineFacts, load: float) -> PrecisionPlan:
    """The default plan for a new session: a typical short text request on this link, at today's load."""
    link = hello.hints.link_kbps
    if link is not None and not link > 0:  # the wire allows 0 (ClientHints: [0, 1e9]); no rate is no measurement
        link = None
    return choose_precision(_features(facts, load, 0, link_kbps=link), None, available_codecs=codecs,
                            available_compute=list(facts.variants))


def request_compute(facts: EngineFacts, load: float, codecs: list[str], prompt_tokens: int,
                    multimodal: bool) -> str:
    """The compute variant of a split request that did not name one."""
    plan = choose_precision(_features(facts, load, prompt_tokens, images=int(multimodal)), None,
                            available_codecs=codecs, available_compute=list(facts.variants))
    return plan.compute


def compute_variant(override: str | None, prompt_len: int, rt) -> str:
    """Full-model mode: the variant for a prompt of ``prompt_len`` tokens; ``override`` (the request's
    ``precision``: a compute variant, or a codec, which has no meaning without a wire and is ignored; a name of
    both, the codec only where this server computes otherwise, as on the edge) wins.
    Raises ``PrecisionError`` for a variant this server did not load."""
    ov = PrecisionOverride.for_server(override, rt.facts.variants)
    ov = PrecisionOverride(compute=ov.compute) if ov is not None and ov.compute is not None else None
    load = load_fraction(rt.num_active_requests(), rt.facts)
    plan = choose_precision(_features(rt.facts, load, prompt_len), ov, available_compute=list(rt.facts.variants))
    return plan.compute


__all__ = ["PrecisionError", "compute_variant", "load_fraction", "request_compute", "session_plan"]
