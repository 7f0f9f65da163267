"""``cloud_server.session_ledger``: sessions counted over every front-end worker in the engine process."""

from __future__ import annotations

import pytest

from cloud_server.auth import Principal
from cloud_server.session_ledger import LedgerEntry, SessionLedger


def _entry(worker: int, token: str, tenant: str = "t", key: str | None = None, cap: int | None = None,
           role: str = "tenant") -> LedgerEntry:
    return LedgerEntry(worker, token, Principal(tenant, key, cap, role=role))


def test_the_server_cap_counts_every_worker_and_a_release_frees_a_slot():
    ledger = SessionLedger(max_sessions=2)
    assert ledger.admit(0, "a", _entry(0, "ta")).refusal is None
    assert ledger.admit(1, "b", _entry(1, "tb")).refusal is None
    refused = ledger.admit(0, "c", _entry(0, "tc"))
    assert refused.refusal[0] == "overloaded" and "limit of 2" in refused.refusal[1] and len(ledger) == 2
    ledger.release("a")
    assert ledger.admit(1, "c", _entry(1, "tc")).refusal is None


def test_a_key_cap_counts_that_keys_sessions_on_every_worker():
    ledger = SessionLedger(max_sessions=10)
    assert ledger.admit(0, "a", _entry(0, "ta", key="k1", cap=2)).refusal is None
    assert ledger.admit(1, "b", _entry(1, "tb", key="k1", cap=2)).refusal is None
    assert ledger.admit(1, "c", _entry(1, "tc", key="k1", cap=2)).refusal[0] == "key_session_cap"
    assert ledger.admit(0, "d", _entry(0, "td", key="k2", cap=2)).refusal is None  # another key: its own count


def test_a_token_held_by_another_worker_is_reclaimed_and_its_slot_reused():
    ledger = SessionLedger(max_sessions=1)
    ledger.admit(0, "a", _entry(0, "ta"))
    got = ledger.admit(1, "b", _entry(1, "tb", key="another key of t"), replaces="ta")
    assert got.refusal is None and got.reclaim == (0, "a") and len(ledger) == 1
    ledger.release("b")
    assert ledger.admit(1, "d", _entry(1, "td"), replaces="unknown").reclaim is None


@pytest.mark.parametrize("opener, presenter", [
    (dict(tenant="t"), dict(tenant="other")),  # another tenant's key
    (dict(tenant="t", role="operator"), dict(tenant="t")),  # a tenant key with its tenant's operator's token
    (dict(tenant="t"), dict(tenant="t", role="operator")),  # and the other way round
], ids=["other tenant", "tenant key, operator session", "operator key, tenant session"])
def test_a_token_presented_by_a_key_not_acting_as_its_opener_reclaims_nothing(opener, presenter):
    """The rule of ``SessionRegistry.for_resume`` (``Principal.acts_as``: same tenant and role) over the workers:
    such a key's new session opens beside the old one, which stays counted and open on its worker (a tenant key
    holding its operator's token closed the operator's session on another worker: only the tenant was compared)."""
    ledger = SessionLedger(max_sessions=4)
    ledger.admit(0, "a", _entry(0, "ta", key="k-open", **opener))
    got = ledger.admit(1, "b", _entry(1, "tb", key="k-present", **presenter), replaces="ta")
    assert got.refusal is None and got.reclaim is None and len(ledger) == 2
    assert ledger.admit(1, "c", _entry(1, "tc", key="k-open", **opener), replaces="ta").reclaim == (0, "a")


def test_a_gone_worker_releases_its_sessions():
    ledger = SessionLedger(max_sessions=3)
    for i, w in enumerate((0, 0, 1)):
        ledger.admit(w, f"s{i}", _entry(w, f"t{i}"))
    assert sorted(ledger.drop_worker(0)) == ["s0", "s1"] and len(ledger) == 1
    assert ledger.admit(1, "x", _entry(1, "tx"), replaces="t0").reclaim is None  # its tokens are gone
