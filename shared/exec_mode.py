"""Where a request runs: the execution mode chosen per request from the link, the request and its privacy level.

Modes:

* ``split`` - the front layers on the phone, the rest in the cloud; hidden states go up, tokens come down
  (speculative steps when the request speculates: ``edge_client.drafting``);
* ``all-cloud`` - the server's full-model endpoint: raw input goes up, the cloud streams the answer (no round
  trip per token);
* ``edge-only`` - the whole model on the phone (a bundle with ``partition_tools.export_whole``'s graph): nothing
  leaves the device;
* ``u-shape`` - head and tail on the phone (a bundle split with ``--tail M``), the middle in the cloud: hidden
  states go up *and* come down, the phone samples (``edge_client.ushape``), so no token id of the output
  reaches the cloud; it costs a hidden row down per position and the tail's compute per token, and gives up the
  cloud's prefix cache. Drafts never leave the phone as ids in this mode (the phone verifies them itself).

Privacy levels:

* ``standard`` - the user allows raw input to leave the device: every available mode may run;
* ``private`` - raw input never leaves the phone: no ``all-cloud``; in ``split`` only hidden states go up, drafts
  come only from tokens the cloud itself produced, and prefix keys are keyed with a per-tenant secret
  (``shared.prefix_keys.KeyScope.secret``) so the cloud cannot confirm a guessed prompt from its keys;
* ``output-private`` - neither input nor output tokens reach the cloud: only ``u-shape`` or ``edge-only``. What
  the cloud still sees in ``u-shape`` is hidden states - the front's, of the prompt *and* of every output token
  fed back, and the middle's - so the inversion risk of docs/security.md applies to the output as it applies to
  the input in ``private``.

:func:`choose_mode` applies the privacy level (a hard filter, also on an override), then, among the modes left
and available, picks the one with the lowest estimated time for the whole request - time to first token plus
``max_tokens`` decode steps - from the measured link (RTT, uplink) and the sizes of what each mode sends. A
link that is down leaves ``edge-only``. The client's override wins if the privacy level and the deployment
allow it. The decision carries the estimates and a one-line reason, reported in the request's stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("split", "all-cloud", "edge-only", "u-shape")
PRIVACY_LEVELS = ("standard", "private", "output-private")
_ALLOWED = {"standard": set(MODES), "private": {"split", "edge-only", "u-shape"},
            "output-private": {"edge-only", "u-shape"}}


class ExecModeError(ValueError):
    """No mode can serve the request under its privacy level (or a bad override / level name)."""


@dataclass(frozen=True, slots=True)
class LinkState:
    connected: bool = True
    rtt_ms: float = 60.0  # measured round trip
    up_kbps: float = 6300.0  # measured uplink
    down_kbps: float = 21000.0


@dataclass(frozen=True, slots=True)
class Deployment:
    """What this phone and its cloud can run, and what each costs (measured or configured)."""

    split: bool = True  # a split bundle and a split endpoint
    all_cloud: bool = False  # a full-model endpoint the client may call
    edge_only: bool = False  # the whole model on the phone
    u_shape: bool = False  # a bundle with a tail (``Manifest.tail_layers``)
    boundary_bytes_per_token: float = 2 * 4096  # one coded hidden row on the wire (fp16, hidden 4096)
    edge_front_token_s: float = 0.01  # the front layers per decoded token on the phone
    edge_front_prefill_token_s: float = 0.002  # per prompt token, in chunks (one pass over the weights per chunk)
    edge_tail_token_s: float = 0.01  # u-shape: the tail layers + lm_head per decoded token on the phone
    edge_tail_prefill_token_s: float = 0.002  # per prompt token (the tail needs every position's KV)
    edge_whole_token_s: float = 0.5  # the whole model per decoded token on the phone
    edge_whole_prefill_token_s: float = 0.05
    cloud_token_s: float = 0.03  # the cloud's decode step
    cloud_prefill_token_s: float = 0.0005  # the cloud's prefill per uncached prompt token (whole model; GPU)
    split_tokens_per_round_trip: float = 1.0  # > 1 with speculation (measured acceptance)
    # u-shape's own (its cloud never sees a token, so it drafts by lookup alone); None: the split's
    ushape_tokens_per_round_trip: float | None = None


@dataclass(frozen=True, slots=True)
class RequestShape:
    prompt_tokens: int
    max_tokens: int
    cached_tokens: int = 0  # prompt tokens both prefix caches hold (the agent's system prompt): split skips them
    images: int = 0
    raw_bytes_per_token: float = 4.0  # raw text per token (UTF-8); images add image_bytes each
    image_bytes: float = 150_000.0


@dataclass(frozen=True, slots=True)
class ModeDecision:
    mode: str
    privacy: str
    reason: str
    estimates_s: dict[str, float] = field(default_factory=dict)  # mode -> estimated request time
    drafts_from_outputs_only: bool = False  # private levels in split: no prompt n-gram leaves as a draft
    secret_prefix_keys: bool = False  # private levels: prefix keys keyed with the tenant secret
    override: str | None = None  # the client's mode override it obeyed (None: chosen by the estimates)

    def to_dict(self) -> dict:
        return {"mode": self.mode, "privacy": self.privacy, "reason": self.reason,
                "estimates_s": {k: round(v, 3) for k, v in self.estimates_s.items()}}


def estimate_s(mode: str, req: RequestShape, link: LinkState, dep: Deployment) -> float:
    """Estimated time of the whole request in ``mode``: TTFT + decode of ``max_tokens``."""
    rtt, up = link.rtt_ms / 1000.0, max(1e-3, link.up_kbps) * 1000 / 8  # s, bytes/s
    if mode == "edge-only":
        return req.prompt_tokens * dep.edge_whole_prefill_token_s + req.max_tokens * dep.edge_whole_token_s
    fresh = max(0, req.prompt_tokens - req.cached_tokens)
    if mode == "all-cloud":
        raw = req.prompt_tokens * req.raw_bytes_per_token + req.images * req.image_bytes
        prefill = fresh * dep.cloud_prefill_token_s
        return rtt + raw / up + prefill + req.max_tokens * dep.cloud_token_s  # streamed: no round trip per token
    row_up = dep.boundary_bytes_per_token / up
    if mode == "split":
        ttft = fresh * (dep.edge_front_prefill_token_s + row_up) + rtt
        step = rtt + dep.cloud_token_s + dep.edge_front_token_s + row_up
        return ttft + req.max_tokens * step / max(1.0, dep.split_tokens_per_round_trip)
    if mode == "u-shape":  # every prompt position goes up and comes back (no cloud prefix cache); the tail runs here
        row_down = dep.boundary_bytes_per_token / (max(1e-3, link.down_kbps) * 1000 / 8)
        ttft = (fresh * dep.edge_front_prefill_token_s
                + req.prompt_tokens * (row_up + row_down + dep.edge_tail_prefill_token_s) + rtt)
        step = rtt + dep.cloud_token_s + dep.edge_front_token_s + dep.edge_tail_token_s + row_up + row_down
        gain = dep.split_tokens_per_round_trip if dep.ushape_tokens_per_round_trip is None \
            else dep.ushape_tokens_per_round_trip
        return ttft + req.max_tokens * step / max(1.0, gain)
    raise ExecModeError(f"unknown mode {mode!r}: expected one of {', '.join(MODES)}")


def _available(mode: str, link: LinkState, dep: Deployment) -> bool:
    needs_link = mode != "edge-only"
    have = {"split": dep.split, "all-cloud": dep.all_cloud, "edge-only": dep.edge_only, "u-shape": dep.u_shape}[mode]
    return have and (link.connected or not needs_link)


def choose_mode(req: RequestShape, privacy: str = "standard", link: LinkState | None = None,
                dep: Deployment | None = None, override: str | None = None) -> ModeDecision:
    """The mode for one request (module docstring); raises :class:`ExecModeError` if none may serve it."""
    link, dep = link or LinkState(), dep or Deployment()
    if privacy not in PRIVACY_LEVELS:
        raise ExecModeError(f"privacy {privacy!r}: expected one of {', '.join(PRIVACY_LEVELS)}")
    allowed = [m for m in MODES if m in _ALLOWED[privacy]]
    private = privacy != "standard"

    def common(mode: str) -> dict:  # u-shape sends no draft id and no prefix key at all
        return {"privacy": privacy, "drafts_from_outputs_only": private and mode == "split",
                "secret_prefix_keys": private}

    if override is not None:
        if override not in MODES:
            raise ExecModeError(f"mode {override!r}: expected one of {', '.join(MODES)}")
        if override not in allowed:
            raise ExecModeError(f"mode {override} would send what privacy level {privacy} keeps on the phone")
        if not _available(override, link, dep):
            raise ExecModeError(f"mode {override} is not available here (link {'up' if link.connected else 'down'})")
        return ModeDecision(override, reason=f"client override ({privacy})", override=override, **common(override))
    live = [m for m in allowed if _available(m, link, dep)]
    if not live:
        why = "the link is down" if not link.connected else "this deployment runs none of them"
        raise ExecModeError(f"privacy {privacy} allows {', '.join(allowed)}, but {why}")
    est = {m: estimate_s(m, req, link, dep) for m in live}
    best = min(live, key=lambda m: (est[m], MODES.index(m)))
    others = ", ".join(f"{m} {est[m]:.2f} s" for m in live if m != best)
    reason = (f"{privacy}: {best} (est. {est[best]:.2f} s" + (f"; {others}" if others else "") + ")"
              + ("" if link.connected else "; link down"))
    return ModeDecision(best, reason=reason, estimates_s=est, **common(best))
