"""The privacy levels, checked on the wire: a recording TCP proxy between the edge client and a real cloud
server parses every WebSocket frame both ways.

* ``private`` (split, speculating): no byte of the raw prompt goes up, every draft the phone sends is a token
  the cloud itself produced, and the prefix keys are not the unsalted ones anyone could recompute for a
  guessed prompt;
* ``output-private`` with a u-shape bundle (``split --tail``): the request runs ``u-shape``, speculating; every
  frame up is a Prefill, StatesStep, Cancel or Close carrying hidden states and no id field (no prefix key, no
  draft, no stop id, no seed), and every frame down is States or an empty final Tokens: no token id of the
  output crosses the link, in either direction;
* ``output-private`` with a plain bundle: the request runs on the phone (``edge-only``): not one frame crosses
  the link; without a whole model on the phone it is refused before any traffic.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from edge_client.client import EdgeClient
from edge_client.config import RetryPolicy
from edge_client.demo import free_port
from edge_client.errors import EdgeClientError
from shared import protocol as P
from shared.prefix_keys import KeyScope, block_keys

RETRY = RetryPolicy(connect_timeout_s=5.0, reply_timeout_s=60.0, max_retries=3)
SECRET = "The launch code is 4417-ZEBRA-OCTOPUS and the vault is behind the painting."
PROMPT = " ".join([SECRET] * 4)


class RecordingProxy:
    """A TCP proxy on its own thread that keeps every byte, per direction."""

    def __init__(self, target_port: int):
        self.target_port, self.port = target_port, free_port()
        self.up, self.down = bytearray(), bytearray()
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        self._started.wait(5)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._started.set()
        self._loop.run_forever()

    async def _handle(self, reader, writer) -> None:
        self.connections += 1
        r2, w2 = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pump(src, dst, sink):
            try:
                while data := await src.read(65536):
                    sink.extend(data)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, w2, self.up), pump(r2, writer, self.down))


def ws_messages(stream: bytes) -> list[bytes]:
    """The binary WebSocket messages of one direction of a connection (after the HTTP upgrade), unmasked
    (RFC 6455: client frames are masked)."""
    i = stream.index(b"\r\n\r\n") + 4
    out, partial = [], b""
    while i + 2 <= len(stream):
        b0, b1 = stream[i], stream[i + 1]
        n, i = b1 & 0x7F, i + 2
        if n == 126:
            n, i = int.from_bytes(stream[i:i + 2], "big"), i + 2
        elif n == 127:
            n, i = int.from_bytes(stream[i:i + 8], "big"), i + 8
        mask = None
        if b1 & 0x80:
            mask, i = stream[i:i + 4], i + 4
        payload = stream[i:i + n]
        i += n
        if mask is not None:
            payload = bytes(c ^ mask[j % 4] for j, c in enumerate(payload))
        opcode = b0 & 0x0F
        if opcode in (0x2, 0x0):
            partial += payload
            if b0 & 0x80:
                out.append(partial)
                partial = b""
    return out


@pytest.fixture(scope="module")
def cloud(tiny_cloud):
    return tiny_cloud  # one server of the tiny bundle for the end-to-end modules (conftest)


def test_private_split_sends_no_raw_text_and_no_prompt_drafts(tiny_bundle, cloud):
    with RecordingProxy(cloud.port) as proxy, \
            EdgeClient(tiny_bundle, f"ws://127.0.0.1:{proxy.port}/v1/split", codec="fp16", retry=RETRY) as c:
        c.session.sizer.choose = lambda limit=None: 4 if limit is None else min(4, limit)  # always draft
        gen = c.complete(prompt=PROMPT, max_tokens=24, speculate=True, privacy="private")
        prompt_ids = c.tokenizer.encode(PROMPT)
    assert gen.stats.exec_mode == "split" and "private" in gen.stats.exec_reason
    up = bytes(proxy.up)
    for needle in (SECRET, "4417-ZEBRA", "OCTOPUS", "painting", "launch code"):
        assert needle.encode() not in up and needle.encode("utf-16-le") not in up
    sent = [P.decode_message(m) for m in ws_messages(up)]
    got = [P.decode_message(m) for m in ws_messages(bytes(proxy.down))]
    kinds = {type(m).__name__ for m in sent}
    assert {"Hello", "Prefill"} <= kinds  # the parser really saw the session
    produced = [t for m in got if isinstance(m, P.Tokens) for t in m.token_ids]
    assert produced == gen.token_ids
    drafts = [t for m in sent if isinstance(m, P.SpecStep) for t in m.draft_ids]
    assert drafts and set(drafts) <= set(produced)  # only tokens the cloud itself sent down
    assert gen.stats.draft_tokens == len(drafts)
    # the keys the cloud got are not the unsalted chain anyone can compute for a guessed prompt
    keys = [k for m in sent if isinstance(m, P.Prefill) for k in m.prefix_keys]
    assert keys
    guess = block_keys(prompt_ids, KeyScope(c.manifest.bundle_id, c.manifest.states_variant, "fp16"), 16)
    assert not set(keys) & set(guess)


def test_a_private_request_opens_its_link_without_the_unsalted_route_key(tiny_bundle, cloud, tmp_path):
    """A client that preloaded a system prompt sent its routing key - the prompt's first prefix key, unsalted, in
    X-Autoglm-Prefix-Key - on the upgrade of a private request's link too, which confirms a guessed system prompt
    as the private level's secret-keyed chain exists not to. A standard request's link still carries it."""
    from edge_client.transport import ROUTE_HEADER

    (tmp_path / "system.txt").write_text(SECRET)
    upgrades = {}
    for privacy in ("private", "standard"):
        with RecordingProxy(cloud.port) as proxy, \
                EdgeClient(tiny_bundle, f"ws://127.0.0.1:{proxy.port}/v1/split", codec="fp16", retry=RETRY) as c:
            c.preload_prompts(tmp_path / "system.txt", as_system=False)
            c.complete(prompt=PROMPT, max_tokens=2, privacy=privacy)
            route = c.session.link.route_key
        upgrades[privacy] = bytes(proxy.up[: proxy.up.index(b"\r\n\r\n")]).decode()
    assert route
    assert ROUTE_HEADER not in upgrades["private"] and route.partition("/")[2] not in upgrades["private"]
    assert f"{ROUTE_HEADER}: {route}" in upgrades["standard"]


def test_a_u_shape_bundles_link_carries_no_route_key(tiny_glm4_ushape_bundle, ushape_cloud, tmp_path):
    """A u-shape request sends no prefix keys (security.md: the cloud prefix cache is off in u-shape), but a client
    that preloaded a system prompt sent its first prefix key - unsalted - as the routing header on the upgrade of
    its u-shape bundle's link: the one key that confirms a guessed system prompt, for no routing gain."""
    from edge_client.transport import ROUTE_HEADER

    (tmp_path / "system.txt").write_text(SECRET)
    with RecordingProxy(ushape_cloud.port) as proxy, \
            EdgeClient(tiny_glm4_ushape_bundle, f"ws://127.0.0.1:{proxy.port}/v1/split", codec="fp16",
                       retry=RETRY) as c:
        c.preload_prompts(tmp_path / "system.txt", as_system=False)
        gen = c.complete(prompt=PROMPT, max_tokens=2)
    assert gen.stats.exec_mode == "u-shape"
    upgrade = bytes(proxy.up[: proxy.up.index(b"\r\n\r\n")]).decode()
    assert ROUTE_HEADER not in upgrade


def test_the_privacy_level_changes_what_leaves_not_the_answer(tiny_bundle, cloud):
    with EdgeClient(tiny_bundle, cloud.ws_url, codec="fp16", retry=RETRY) as c:
        gen = c.complete(prompt=PROMPT, max_tokens=24, speculate=True)
        private = c.complete(prompt=PROMPT, max_tokens=24, speculate=True, privacy="private")
    assert gen.token_ids == private.token_ids  # the level changes what leaves, not the answer
    assert gen.stats.exec_mode == "split"


def test_output_private_runs_u_shape_and_no_token_id_reaches_the_cloud(tiny_glm4_ushape_bundle, ushape_cloud):
    with RecordingProxy(ushape_cloud.port) as proxy, \
            EdgeClient(tiny_glm4_ushape_bundle, f"ws://127.0.0.1:{proxy.port}/v1/split", codec="fp16",
                       retry=RETRY) as c:
        c.session.sizer.choose = lambda limit=None: 4 if limit is None else min(4, limit)  # always draft
        prompt_ids = [int(t) for t in range(10, 60)] * 2  # repeats: drafts get accepted
        gen = c.complete(prompt_ids=prompt_ids, max_tokens=24, speculate=True, seed=3, privacy="output-private")
    assert gen.stats.exec_mode == "u-shape" and "output-private" in gen.stats.exec_reason
    assert gen.token_ids and gen.stats.draft_tokens > 0
    sent = [P.decode_message(m) for m in ws_messages(bytes(proxy.up))]
    got = [P.decode_message(m) for m in ws_messages(bytes(proxy.down))]
    assert {type(m).__name__ for m in sent} <= {"Hello", "Prefill", "StatesStep", "Cancel", "Close"}
    assert {type(m).__name__ for m in got} <= {"Welcome", "States", "Tokens"}
    assert any(isinstance(m, P.StatesStep) and m.n_tokens > 1 for m in sent)  # speculative steps went up
    for m in sent:
        if isinstance(m, P.Prefill):
            assert m.return_states and not m.prefix_keys
            if m.params is not None:
                assert m.params.seed is None and not m.params.stop_token_ids and m.params.temperature == 1.0
    assert all(not m.token_ids for m in got if isinstance(m, P.Tokens))  # only the empty final one
    assert sum(m.n_tokens for m in got if isinstance(m, P.States)) >= len(prompt_ids) + len(gen.token_ids) - 1


@pytest.fixture(scope="module")
def whole_model(tiny_glm4_whole):
    """The whole tiny-glm4 model on the phone (the session's fp32 export, tests/conftest.py)."""
    from rig.all_edge import WholeModelRunner

    return WholeModelRunner(tiny_glm4_whole, threads=1)


def test_output_private_runs_on_the_phone_and_sends_nothing(tiny_bundle, cloud, whole_model):
    with RecordingProxy(cloud.port) as proxy, \
            EdgeClient(tiny_bundle, f"ws://127.0.0.1:{proxy.port}/v1/split", retry=RETRY,
                       whole_model=whole_model) as c:
        gen = c.complete(prompt=PROMPT, max_tokens=12, privacy="output-private")
    assert gen.stats.exec_mode == "edge-only" and gen.token_ids
    assert proxy.connections == 0 and not proxy.up and not proxy.down


def test_output_private_without_a_whole_model_is_refused_before_any_traffic(tiny_bundle, cloud):
    with RecordingProxy(cloud.port) as proxy, \
            EdgeClient(tiny_bundle, f"ws://127.0.0.1:{proxy.port}/v1/split", retry=RETRY) as c:
        with pytest.raises(EdgeClientError, match="output-private") as e:
            c.generate(prompt=PROMPT, max_tokens=4, privacy="output-private")
    assert e.value.code == "exec_mode" and proxy.connections == 0


def test_agenerate_takes_the_privacy_level_as_generate_does(tiny_bundle, cloud, whole_model):
    """The async twin takes the same arguments (docs/edge.md): ``privacy=`` / ``mode=`` were a TypeError and its
    requests never went through the mode decision."""
    async def run(c):
        gen = c.agenerate(prompt=PROMPT, max_tokens=12, privacy="output-private")
        return gen, [d async for d in gen]

    with RecordingProxy(cloud.port) as proxy, \
            EdgeClient(tiny_bundle, f"ws://127.0.0.1:{proxy.port}/v1/split", retry=RETRY,
                       whole_model=whole_model) as c:
        gen, deltas = asyncio.run(run(c))
        assert c.complete(prompt=PROMPT, max_tokens=12, privacy="output-private").token_ids == gen.token_ids
    assert gen.stats.exec_mode == "edge-only" and gen.token_ids and "".join(deltas) == gen.text
    assert proxy.connections == 0 and not proxy.up and not proxy.down


def test_stop_strings_end_an_edge_only_answer_as_they_end_a_split_one(tiny_bundle, cloud, whole_model):
    """The edge-only runner returns its whole answer at once; the stop strings used to be ignored there (the text
    ran on past them, finish_reason "length")."""
    with EdgeClient(tiny_bundle, cloud.ws_url, retry=RETRY, whole_model=whole_model) as c:
        whole = c.complete(prompt=PROMPT, max_tokens=12, mode="edge-only")
        stop = next(ch for ch in whole.text if ch.strip())
        split = c.complete(prompt=PROMPT, max_tokens=12, stop=stop)
        edge = c.complete(prompt=PROMPT, max_tokens=12, stop=stop, mode="edge-only")
    assert split.finish_reason == edge.finish_reason == "stop" and stop not in edge.text
    assert (edge.text, edge.token_ids) == (split.text, split.token_ids) and len(edge.token_ids) < 12


def test_edge_only_iter_tokens_deltas_join_to_the_text(tiny_bundle, cloud, whole_model):
    """The text held to the end (here the last character, which may begin the stop string) came as a delta of no
    token, which iter_tokens() dropped; the last token carries it (as in split mode)."""
    with EdgeClient(tiny_bundle, cloud.ws_url, retry=RETRY, whole_model=whole_model) as c:
        whole = c.complete(prompt=PROMPT, max_tokens=12, mode="edge-only").text
        gen = c.generate(prompt=PROMPT, max_tokens=12, mode="edge-only", stop=[whole[-1] + "\x00never"])
        pairs = list(gen.iter_tokens())
    assert [t for t, _ in pairs] == gen.token_ids and len(pairs) == 12
    assert "".join(d for _, d in pairs) == gen.text == whole


def test_a_sampled_request_is_not_run_greedily_on_the_phone(tiny_bundle, cloud, whole_model):
    """The edge-only runner decodes greedily: a request with a temperature used to run there anyway and come
    back greedy without a word (its temperature and seed ignored); it is refused before any traffic."""
    with RecordingProxy(cloud.port) as proxy, \
            EdgeClient(tiny_bundle, f"ws://127.0.0.1:{proxy.port}/v1/split", retry=RETRY,
                       whole_model=whole_model) as c:
        for kw in ({"privacy": "output-private"}, {"mode": "edge-only"}):
            with pytest.raises(EdgeClientError, match="greedily") as e:
                c.generate(prompt=PROMPT, max_tokens=4, temperature=0.8, seed=1, **kw)
            assert e.value.code == "exec_mode"
        assert proxy.connections == 0
        assert c.complete(prompt=PROMPT, max_tokens=4, privacy="output-private").stats.exec_mode == "edge-only"


def test_edge_only_and_all_cloud_answers_have_a_ttft_and_a_decode_rate(tiny_bundle, cloud, whole_model):
    """The edge-only and all-cloud runners return their answer whole: ``ttft_s`` stayed None and ``tokens_per_s``
    0 there. They are the runner's own timings now (the rig's report them; cut to the tokens a stop string
    leaves), or the whole answer's time for a runner that reports none."""
    class Plain:  # a runner with token ids only
        def generate(self, ids, max_tokens):
            return type("R", (), {"token_ids": whole_model.generate(ids, max_tokens).token_ids})()

    with EdgeClient(tiny_bundle, cloud.ws_url, retry=RETRY, whole_model=whole_model, all_cloud=whole_model) as c:
        for mode in ("edge-only", "all-cloud"):
            st = c.complete(prompt=PROMPT, max_tokens=12, mode=mode).stats
            assert st.exec_mode == mode and st.completion_tokens == 12
            assert 0 < st.ttft_s <= st.total_s and len(st.itl_s) == 11 and st.tokens_per_s > 0
        text = c.complete(prompt=PROMPT, max_tokens=12, mode="edge-only").text
        stop = next(ch for ch in text if ch.strip())
        st = c.complete(prompt=PROMPT, max_tokens=12, stop=stop, mode="edge-only").stats
        assert len(st.itl_s) == st.completion_tokens - 1
    with EdgeClient(tiny_bundle, cloud.ws_url, retry=RETRY, whole_model=Plain()) as c:
        st = c.complete(prompt=PROMPT, max_tokens=12, mode="edge-only").stats
        assert st.ttft_s == st.total_s > 0 and st.tokens_per_s == 0.0


def test_a_runner_result_that_fails_after_its_generate_ends_the_request_with_an_error(tiny_bundle):
    """An edge-only / all-cloud runner whose result the client cannot read (a token id that is no integer) raised
    on the client's loop after the runner's guarded call, and nothing told the stream: the caller's iteration (and
    the local API's response) waited for ever. The request ends with an internal EdgeClientError."""

    class Malformed:
        def generate(self, prompt_ids, max_tokens):
            return type("Result", (), {"token_ids": [1, "x"]})()

    with EdgeClient(tiny_bundle, "ws://127.0.0.1:9", retry=RETRY, whole_model=Malformed()) as c:
        gen = c.generate(prompt_ids=[5, 6, 7], max_tokens=4, mode="edge-only")
        with pytest.raises(EdgeClientError) as ei:
            list(gen)
        assert ei.value.code == "internal" and "ValueError" in str(ei.value)

        async def consume():
            async for _ in c.agenerate(prompt_ids=[5, 6, 7], max_tokens=4, mode="edge-only"):
                pass

        with pytest.raises(EdgeClientError, match="ValueError"):
            asyncio.run(asyncio.wait_for(consume(), 30))


def test_every_mode_ends_an_answer_by_the_splits_rule(tiny_bundle, cloud, whole_model, tiny_glm4_whole):
    """The edge-only and all-cloud runners answered past the context (max_tokens never cut to it) and called a short
    answer "stop" whatever cut it, and WholeModelRunner left its end-of-sequence token out of the count the split
    keeps it in. Every mode cuts max_tokens to the context (Session.fit) and ends by request.answer_end."""
    from rig.all_edge import WholeModelRunner

    with EdgeClient(tiny_bundle, cloud.ws_url, retry=RETRY, whole_model=whole_model, all_cloud=whole_model) as c:
        c.complete(prompt_ids=[5, 6, 7], max_tokens=1, mode="split")  # the session's limits known
        ids = [5 + i % 50 for i in range(c.session.max_context - 3)]  # room for 3 tokens
        got = {mode: c.complete(prompt_ids=ids, max_tokens=10, mode=mode) for mode in ("split", "edge-only",
                                                                                       "all-cloud")}
        assert {(g.finish_reason, g.stats.completion_tokens, len(g.token_ids)) for g in got.values()} == \
            {("length", 3, 3)}
    runner = WholeModelRunner(tiny_glm4_whole, threads=1)
    full = runner.generate([5, 6, 7], 10).token_ids
    k = next(i for i in range(1, len(full)) if full[i] not in full[:i])
    runner.eos = {full[k]}  # the answer's (k+1)-th token ends it: counted, as the split counts its eos
    with EdgeClient(tiny_bundle, cloud.ws_url, retry=RETRY, whole_model=runner) as c:
        g = c.complete(prompt_ids=[5, 6, 7], max_tokens=10, mode="edge-only")
    assert g.token_ids == full[:k + 1] and g.stats.completion_tokens == k + 1 and g.finish_reason == "stop"
