"""Precision per request on the cloud: the shared policy (``shared.precision``) applied to this server.

The policy is a pure function of the request (prompt length, images), the client's link hint and the
server's load; the cloud runs it with what it actually offers: the codecs negotiated with the session and
the compute variants it loaded. It is applied at three points:

* :func:`session_plan` - the session's default plan, sent in ``Welcome.plan``;
* :func:`request_compute` - a split request's compute variant when its ``Prefill.compute`` is empty
  (the first ``Tokens`` reports the plan used);
* :func:`compute_variant` - a full-model request's variant, with the OpenAI ``precision`` override.
"""

from __future__ import annotations

from shared.precision import (
    PrecisionError,
    PrecisionOverride,
    PrecisionPlan,
    RequestFeatures,
    choose_precision,
)


def server_load(rt) -> float:
    """Busy fraction in [0, 1]: open requests over the engine's sequence capacity."""
    eng = rt.engine.llm
    return min(1.0, len(eng.seqs) / max(1, rt.config.engine.max_num_seqs))


def _features(rt, prompt_tokens: int, images: int = 0, link_kbps: float | None = None) -> RequestFeatures:
    hidden = rt.manifest.hidden_size if rt.manifest is not None else rt.engine.llm.runners[
        rt.engine.llm.default_variant].model.hidden_size
    return RequestFeatures(prompt_tokens=prompt_tokens, images=images, link_kbps=link_kbps,
                           server_load=server_load(rt), hidden_size=hidden)


def session_plan(hello, codecs: list[str], rt) -> PrecisionPlan:
    """The default plan for a new session: a typical short text request on this link, at today's load."""
    hints = getattr(hello, "hints", None)
    link = getattr(hints, "link_kbps", None)
    return choose_precision(_features(rt, 0, link_kbps=link), None, available_codecs=codecs,
                            available_compute=list(rt.engine.llm.runners))


def request_compute(rt, session, prompt_tokens: int, multimodal: bool) -> str:
    """The compute variant of a split request that did not name one."""
    plan = choose_precision(_features(rt, prompt_tokens, images=int(multimodal)), None,
                            available_codecs=session.codecs, available_compute=list(rt.engine.llm.runners))
    return plan.compute


def compute_variant(override: str | None, prompt_len: int, rt) -> str:
    """Full-model mode: the variant for a prompt of ``prompt_len`` tokens; ``override`` (the request's
    ``precision``: a compute variant, or a codec, which has no meaning without a wire and is ignored) wins.
    Raises ``PrecisionError`` for a variant this server did not load."""
    ov = PrecisionOverride.parse(override)
    ov = PrecisionOverride(compute=ov.compute) if ov is not None and ov.compute is not None else None
    plan = choose_precision(_features(rt, prompt_len), ov, available_compute=list(rt.engine.llm.runners))
    return plan.compute


__all__ = ["PrecisionError", "compute_variant", "request_compute", "server_load", "session_plan"]
