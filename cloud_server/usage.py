"""Per-key accounting and request tracing, for split sessions and full-model (``--full``) requests.

Split: usage is counted from the messages a session exchanges, so it is what the tenant actually sent and received:

* ``autoglm:tenant_sessions_total{tenant}`` sessions opened; ``autoglm:tenant_sessions_open{tenant}``;
* ``autoglm:tenant_requests_total{tenant}`` requests opened (a request's first ``Prefill``);
* ``autoglm:tenant_prompt_tokens_total{tenant}`` positions uploaded in ``Prefill`` messages;
* ``autoglm:tenant_generation_tokens_total{tenant}`` tokens sampled for it (``Tokens.token_ids``);
* ``autoglm:tenant_uplink_bytes_total{tenant}`` / ``autoglm:tenant_downlink_bytes_total{tenant}`` frame bytes.

Full-model mode (``cloud_server.full_api``) counts the same requests, prompt and generation series, per
:class:`RequestMeter`: a request counts once the engine takes it (a refusal before, a 400, is no request), its
prompt's tokens then, once - a replay after the engine dropped it for load re-prefills the prompt and the tokens so
far, the server's own cost, not billed again - and each token when it is sampled (a replay goes on at the next one),
so a stream cancelled or gone counts the tokens generated until then and a failed request what it had; a finished
answer's counts are its ``usage`` field's. It keeps no prefix cache (``cached_tokens`` is 0) and sends no frames.

All carry ``model_name`` as well, like the rest of ``cloud_server.metrics``. The ``tenant`` label is the keys
file's tenant name for a key of the store (a set the operator bounds); every other client is counted under
``unkeyed``, so an open server cannot be made to grow a label per invented bearer token.

Tracing: a request's trace id is the ``request_id`` the edge chose for it (the edge logs the same id; a
replayed request keeps its first id as the trace, ``edge_client.generation``). The cloud logs one line when a
request opens (``trace=<id> session=<id> tenant=<t> open``) and one when it finishes (``... finish=<reason>
tokens=<n>``, or ``... error=<code>``), on the ``autoglm.cloud.trace`` logger. A full-model request's trace id is
its first engine request's id (``req-...``, kept over its replays) and its lines name no session
(``trace=<id> tenant=<t> open prompt=<n>``, ``... finish=<reason> tokens=<n>`` with ``cancelled`` for a client gone
first, ``... error=<code> tokens=<n>``).
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge

from shared import protocol as P

trace_log = logging.getLogger("autoglm.cloud.trace")
UNKEYED = "unkeyed"


def tenant_label(principal) -> str:
    if principal is None or not principal.metered:
        return UNKEYED
    return principal.tenant.removeprefix("tenant:")


class TenantUsage:
    """The per-tenant counters, registered on the server's metrics registry."""

    def __init__(self, metrics):
        r, lab = metrics.registry, ["model_name", "tenant"]
        self.model_name = metrics.model_name
        self.sessions = Counter("autoglm:tenant_sessions", "Split sessions opened, by tenant", lab, registry=r)
        self.sessions_open = Gauge("autoglm:tenant_sessions_open", "Split sessions open, by tenant", lab,
                                   registry=r)
        self.requests = Counter("autoglm:tenant_requests", "Requests opened, by tenant", lab, registry=r)
        self.prompt_tokens = Counter("autoglm:tenant_prompt_tokens",
                                     "Prompt tokens (split: positions uploaded), by tenant", lab, registry=r)
        self.generation_tokens = Counter("autoglm:tenant_generation_tokens", "Tokens generated, by tenant", lab,
                                         registry=r)
        self.uplink = Counter("autoglm:tenant_uplink_bytes", "Frame bytes received, by tenant", lab, registry=r)
        self.downlink = Counter("autoglm:tenant_downlink_bytes", "Frame bytes sent, by tenant", lab, registry=r)
        self._children: dict[tuple, object] = {}  # (counter, labels) -> its child (:meth:`_kid`)

    @classmethod
    def of(cls, metrics) -> TenantUsage:
        """The one instance on ``metrics`` (created with the first session or full-model request: metrics exist once
        the runtime runs)."""
        usage = getattr(metrics, "_tenant_usage", None)
        if usage is None:
            usage = metrics._tenant_usage = cls(metrics)
        return usage

    def _l(self, session):
        return (self.model_name, tenant_label(getattr(session, "principal", None)))

    def _kid(self, counter: Counter, lab: tuple):
        """``counter.labels(*lab)``, looked up once per counter and label set (a bounded one: the keys file's
        tenants and ``unkeyed``), not once per frame."""
        kid = self._children.get((counter, lab))
        if kid is None:
            kid = self._children[(counter, lab)] = counter.labels(*lab)
        return kid

    # -- hooks (event-loop thread) ---------------------------------------------------------------
    def on_open(self, session) -> None:
        self.sessions.labels(*self._l(session)).inc()
        self.sessions_open.labels(*self._l(session)).inc()

    def on_close(self, session) -> None:
        self.sessions_open.labels(*self._l(session)).dec()

    def on_received(self, session, msg, nbytes: int) -> None:
        lab = self._l(session)
        self._kid(self.uplink, lab).inc(nbytes)
        if isinstance(msg, P.Prefill):
            self._kid(self.prompt_tokens, lab).inc(msg.n_tokens)
            if msg.params is not None:  # a request's first message
                self._kid(self.requests, lab).inc()
                trace_log.info("trace=%s session=%s tenant=%s open start=%d", msg.request_id, session.session_id,
                               lab[1], msg.start)

    def on_sent(self, session, msg, nbytes: int) -> None:
        lab = self._l(session)
        if nbytes:
            self._kid(self.downlink, lab).inc(nbytes)
        if isinstance(msg, P.Tokens):
            if msg.token_ids:
                self._kid(self.generation_tokens, lab).inc(len(msg.token_ids))
            if msg.finish_reason is not None:
                rec = session.record(msg.request_id)
                n = len(rec.tokens) if rec is not None else 0
                trace_log.info("trace=%s session=%s tenant=%s finish=%s tokens=%d", msg.request_id,
                               session.session_id, lab[1], msg.finish_reason, n)
        elif isinstance(msg, P.Error) and msg.request_id and (
                msg.request_id in session.state.requests or msg.request_id in session.state.finished):
            # a request that opened (or was refused on its first Prefill) ends; an id the session never
            # opened (unknown_request, resume_failed of a stranger) has no trace: one line per such frame
            # let a client write ~110 bytes of log for every 8-byte Resume
            trace_log.info("trace=%s session=%s tenant=%s error=%s", msg.request_id, session.session_id, lab[1],
                           msg.code)

    def request(self, principal, trace_id: str, prompt_tokens: int) -> RequestMeter:
        """A full-model request the engine took: counted, its prompt's tokens too, and its open line traced."""
        lab = (self.model_name, tenant_label(principal))
        self._kid(self.requests, lab).inc()
        self._kid(self.prompt_tokens, lab).inc(prompt_tokens)
        trace_log.info("trace=%s tenant=%s open prompt=%d", trace_id, lab[1], prompt_tokens)
        return RequestMeter(trace_id, lab[1], self._kid(self.generation_tokens, lab))


class RequestMeter:
    """One full-model request's usage after its open (:meth:`TenantUsage.request`): its sampled tokens, and its one
    finish or error line."""

    def __init__(self, trace_id: str, tenant: str, generated):
        self.trace_id, self.tenant, self._generated = trace_id, tenant, generated
        self.ended = False

    def sampled(self) -> None:
        """One token sampled for the request (its first engine request's or a replay's: each position once)."""
        self._generated.inc()

    def end(self, finish_reason: str, tokens: int, error_code: str | None = None) -> None:
        """The request's trace line, once (later calls are ignored): its finish, or ``error_code``."""
        if self.ended:
            return
        self.ended = True
        if error_code is not None:
            trace_log.info("trace=%s tenant=%s error=%s tokens=%d", self.trace_id, self.tenant, error_code, tokens)
        else:
            trace_log.info("trace=%s tenant=%s finish=%s tokens=%d", self.trace_id, self.tenant, finish_reason,
                           tokens)
