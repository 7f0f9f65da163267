"""The rig's link profiles: the built-in ones (``shared.link_profiles``) and custom ones from a scenario.

    profile = resolve_profile("4g")                                  # a built-in name
    profile = resolve_profile({"name": "sat", "rtt_ms": 600, "down_mbps": 50, "up_mbps": 5})  # custom
    profile = resolve_profile({"base": "4g", "loss": 0.0})            # a built-in with fields changed
"""

from __future__ import annotations

from dataclasses import fields, replace

from shared.link_profiles import MSS, PROFILES, LinkProfile, LinkProfileError, get_profile

__all__ = ["MSS", "PROFILES", "LinkProfile", "LinkProfileError", "get_profile", "resolve_profile"]

_FIELDS = {f.name for f in fields(LinkProfile)}


def resolve_profile(spec: str | dict | LinkProfile) -> LinkProfile:
    """A :class:`LinkProfile` from a built-in name, a full dict of fields, or ``{"base": NAME, ...}``."""
    if isinstance(spec, LinkProfile):
        return spec
    if isinstance(spec, str):
        return get_profile(spec)
    if not isinstance(spec, dict):
        raise LinkProfileError(f"link profile: expected a name or a mapping, got {type(spec).__name__}")
    values = dict(spec)
    base = values.pop("base", None)
    unknown = sorted(str(k) for k in set(values) - _FIELDS)  # (a number key: "sequence item 0: expected str")
    if unknown:
        raise LinkProfileError(f"link profile: unknown field(s) {', '.join(unknown)}")
    if base is not None:
        values.setdefault("name", f"{base}*")
        return replace(get_profile(base), **values)
    missing = sorted({"name", "rtt_ms", "down_mbps", "up_mbps"} - set(values))
    if missing:
        raise LinkProfileError(f"custom link profile: missing field(s) {', '.join(missing)}")
    values.setdefault("jitter_ms", 0.0)
    values.setdefault("loss", 0.0)
    return LinkProfile(**values)
