"""Progress Tokens (docs/protocol.md, "Progress"): while the cloud computes a request for longer than the edge's
reply timeout - a long prompt on a CPU cloud, a wait in the queue - the edge hears that it is alive and does not
take the quiet for a dropped link (before: "link down" and a reconnect per reply timeout, each resending work).
And the other way a request can end without its answer: a final Tokens with finish_reason "error"."""

from __future__ import annotations

import time

import pytest
from cloud_support import edge_generate, serving

from cloud_server.config import EngineConfig, ServerConfig
from edge_client.config import RetryPolicy
from edge_client.errors import EdgeClientError

PROMPT = [17, 200, 31, 5, 99, 140, 7, 63, 250, 11, 42, 77]
N_NEW = 6
REPLY_TIMEOUT_S = 1.0
STALL_S = 2.5  # the prompt's forward pass: over two reply timeouts (a progress Tokens every <= 0.3 s below)


@pytest.fixture(scope="module")
def server(tiny_bundle):
    engine = EngineConfig(num_blocks=64, block_size=4, max_model_len=256)
    with serving(ServerConfig(bundle=tiny_bundle, engine=engine, session_grace_s=5.0)) as srv:
        yield srv


def _stall_prefills(server, monkeypatch, stall_s: float) -> None:
    """Every forward pass with more than one new row (a prompt) takes ``stall_s`` more: a slow cloud."""
    runner = server.runtime.engine.llm.runners["fp32"]
    run = runner.run

    def slow(batch):
        if max(batch.query_lens) > 1:
            time.sleep(stall_s)
        return run(batch)

    monkeypatch.setattr(runner, "run", slow)


def _generate(server, tiny_bundle):
    retry = RetryPolicy(reply_timeout_s=REPLY_TIMEOUT_S, max_retries=3, backoff_initial_s=0.05)
    return edge_generate(tiny_bundle, f"ws://127.0.0.1:{server.port}", PROMPT, N_NEW, retry)


def test_a_long_prefill_is_not_a_dropped_link(server, tiny_bundle, monkeypatch):
    monkeypatch.setattr("cloud_server.split_endpoint.PROGRESS_TICK_S", 0.1)
    monkeypatch.setattr("cloud_server.split_endpoint.PROGRESS_QUIET_S", 0.3)
    expected, _ = _generate(server, tiny_bundle)
    _stall_prefills(server, monkeypatch, STALL_S)
    t0 = time.monotonic()
    tokens, stats = _generate(server, tiny_bundle)
    assert time.monotonic() - t0 >= STALL_S  # the stall happened
    assert tokens == expected
    assert (stats.reconnects, stats.resumes, stats.replays) == (0, 0, 0)


def test_without_progress_the_stall_looks_like_a_drop(server, tiny_bundle, monkeypatch):
    """The control: the same stall with progress off (its interval beyond the stall) is taken for a dead link,
    so the test above can fail."""
    monkeypatch.setattr("cloud_server.split_endpoint.PROGRESS_QUIET_S", 3600.0)
    _stall_prefills(server, monkeypatch, STALL_S)
    try:
        _, stats = _generate(server, tiny_bundle)
    except EdgeClientError as e:  # it gave up reconnecting
        assert "link" in str(e) or e.code in ("link_down", "timeout"), e
    else:
        assert stats.reconnects >= 1


def test_a_request_the_cloud_ends_with_an_error_raises(server, tiny_bundle, monkeypatch):
    """A Tokens(finish_reason="error") (an engine finish the server has no wire name for; older servers also
    answered a Resume so) ended the answer as if it were complete: the edge returned the tokens so far with no
    exception, where every other failure raises."""
    monkeypatch.setattr("cloud_server.split_translate.WIRE_FINISH", {})  # every finish goes out as "error"
    with pytest.raises(EdgeClientError) as e:
        _generate(server, tiny_bundle)
    assert e.value.code == "internal" and "ended the request with an error" in str(e.value)
