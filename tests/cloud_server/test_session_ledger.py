"""``cloud_server.session_ledger``: sessions counted over every front-end worker in the engine process."""

from __future__ import annotations

from cloud_server.session_ledger import LedgerEntry, SessionLedger


def _entry(worker: int, token: str, tenant: str = "t", key: str | None = None) -> LedgerEntry:
    return LedgerEntry(worker, token, tenant, key)


def test_the_server_cap_counts_every_worker_and_a_release_frees_a_slot():
    ledger = SessionLedger(max_sessions=2)
    assert ledger.admit(0, "a", _entry(0, "ta"), None).refusal is None
    assert ledger.admit(1, "b", _entry(1, "tb"), None).refusal is None
    refused = ledger.admit(0, "c", _entry(0, "tc"), None)
    assert refused.refusal[0] == "overloaded" and "limit of 2" in refused.refusal[1] and len(ledger) == 2
    ledger.release("a")
    assert ledger.admit(1, "c", _entry(1, "tc"), None).refusal is None


def test_a_key_cap_counts_that_keys_sessions_on_every_worker():
    ledger = SessionLedger(max_sessions=10)
    assert ledger.admit(0, "a", _entry(0, "ta", key="k1"), 2).refusal is None
    assert ledger.admit(1, "b", _entry(1, "tb", key="k1"), 2).refusal is None
    assert ledger.admit(1, "c", _entry(1, "tc", key="k1"), 2).refusal[0] == "key_session_cap"
    assert ledger.admit(0, "d", _entry(0, "td", key="k2"), 2).refusal is None  # another key: its own count


def test_a_token_held_by_another_worker_is_reclaimed_and_its_slot_reused():
    ledger = SessionLedger(max_sessions=1)
    ledger.admit(0, "a", _entry(0, "ta"), None)
    got = ledger.admit(1, "b", _entry(1, "tb"), None, replaces="ta")
    assert got.refusal is None and got.reclaim == (0, "a") and len(ledger) == 1
    # another tenant presenting the token reclaims nothing
    assert ledger.admit(0, "c", _entry(0, "tc", tenant="other"), None, replaces="tb").reclaim is None
    ledger.release("b")
    assert ledger.admit(1, "d", _entry(1, "td"), None, replaces="unknown").reclaim is None


def test_a_gone_worker_releases_its_sessions():
    ledger = SessionLedger(max_sessions=3)
    for i, w in enumerate((0, 0, 1)):
        ledger.admit(w, f"s{i}", _entry(w, f"t{i}"), None)
    assert sorted(ledger.drop_worker(0)) == ["s0", "s1"] and len(ledger) == 1
    assert ledger.admit(1, "x", _entry(1, "tx"), None, replaces="t0").reclaim is None  # its tokens are gone
