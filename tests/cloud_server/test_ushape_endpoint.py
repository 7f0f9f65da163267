"""The split endpoint serving a u-shape bundle (``split --tail``), over the real protocol: it returns the middle's
states for every position (never a token), rolls back on a StatesStep that starts early, refuses sampling
requests (and a sampling server refuses u-shape ones), never resumes a u-shape request, and ends it on Cancel."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from cloud_support import EdgeSim, boundary, edge_front, serving

from cloud_server.config import EngineConfig, ServerConfig
from partition_tools.cloud_half import CloudModel
from shared import codecs as C
from shared import protocol as P
from shared.manifest import Manifest

FP16 = C.get_codec("fp16")
PROMPT = [17, 200, 31, 5, 99, 140, 7, 63, 250, 11]
ENGINE = EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)  # 2 prompt chunks


def _edge(srv, bundle) -> EdgeSim:
    return EdgeSim(srv.ws_url, bundle, Manifest.load(bundle).bundle_id, front=edge_front(bundle))


async def _states(edge: EdgeSim, rid: str, until: int) -> dict[int, np.ndarray]:
    """States for ``rid`` until positions [.., until) are covered: position -> row [H]."""
    got: dict[int, np.ndarray] = {}
    while not got or max(got) + 1 < until:
        msg = await edge.recv(timeout=30)
        assert isinstance(msg, P.States) and msg.request_id == rid, msg
        rows = FP16.decode(msg.hidden)  # [n, H]
        got.update({msg.start + j: rows[j] for j in range(msg.n_tokens)})
    return got


def test_u_shape_server_returns_middle_states_and_rolls_back(tiny_glm4_ushape_bundle):
    bundle = tiny_glm4_ushape_bundle
    middle = CloudModel.from_bundle(bundle)
    front = edge_front(bundle)
    ids = [*PROMPT, 44, 45, 46]
    with torch.no_grad():
        ref = middle(boundary(front, ids)[None], torch.arange(len(ids))[None])[0].numpy()  # [13, H]

    async def run(srv):
        edge = _edge(srv, bundle)
        await edge.connect()
        f = edge.front.fork()
        h = boundary(f, PROMPT)
        await edge.send(P.Prefill(request_id="u", start=0, hidden=edge.encode(h[:6]), last=False,
                                  params=P.SamplingParams(), return_states=True))
        await edge.send(P.Prefill(request_id="u", start=6, hidden=edge.encode(h[6:])))
        got = await _states(edge, "u", len(PROMPT))
        await edge.send(P.StatesStep(request_id="u", position=10, hidden=edge.encode(boundary(f, [44, 99, 98]))))
        got.update(await _states(edge, "u", 13))
        f.truncate(11)  # two drafts rejected: the next step starts at 11 and the server drops [11, 13)
        await edge.send(P.StatesStep(request_id="u", position=11, hidden=edge.encode(boundary(f, [45, 46]))))
        got.update(await _states(edge, "u", 13))
        # a Resume names the positions whose States the edge holds (none here): the server rolls back to them
        await edge.send(P.Resume(request_id="u", have_tokens=0))
        back = await edge.recv(timeout=30)
        assert isinstance(back, P.Resumed) and (back.request_id, back.received, back.index) == ("u", 0, 0)
        await edge.send(P.Cancel(request_id="u"))
        end = await edge.recv(timeout=30)
        assert isinstance(end, P.Tokens) and end.request_id == "u" and end.finish_reason == "cancelled"
        await edge.send(P.Prefill(request_id="t", start=0, hidden=edge.encode(h[:6]), params=P.SamplingParams()))
        err = await edge.recv(timeout=30)
        assert isinstance(err, P.Error) and err.code == "bad_input" and "return_states" in err.message
        await edge.send(P.Prefill(request_id="v", start=0, hidden=edge.encode(h[:6]), params=P.SamplingParams(),
                                  return_states=True))
        await _states(edge, "v", 6)
        await edge.send(P.Cancel(request_id="v"))
        end = await edge.recv(timeout=30)
        assert isinstance(end, P.Tokens) and end.token_ids == [] and end.finish_reason == "cancelled"
        return got

    with serving(ServerConfig(bundle=bundle, engine=ENGINE)) as srv:
        got = asyncio.run(run(srv))
        assert srv.runtime.engine.llm.num_used_blocks() == 0
    np.testing.assert_allclose(np.stack([got[p] for p in range(13)]), ref, atol=2e-2, rtol=1e-2)  # fp16 both ways


def test_a_sampling_server_refuses_u_shape_requests(tiny_bundle):
    async def run(srv):
        edge = _edge(srv, tiny_bundle)
        await edge.connect()
        h = boundary(edge.front.fork(), PROMPT[:6])
        await edge.send(P.Prefill(request_id="u", start=0, hidden=edge.encode(h), params=P.SamplingParams(),
                                  return_states=True))
        err = await edge.recv(timeout=30)
        assert isinstance(err, P.Error) and err.code == "bad_input" and "cannot return states" in err.message

    with serving(ServerConfig(bundle=tiny_bundle, engine=ENGINE)) as srv:
        asyncio.run(run(srv))


def test_u_shape_bundles_refuse_tensor_parallel(tiny_glm4_ushape_bundle):
    from cloud_server.config import ConfigError
    from cloud_server.runtime import CloudRuntime

    cfg = ServerConfig(bundle=tiny_glm4_ushape_bundle, engine=EngineConfig(tp=2))
    with pytest.raises(ConfigError, match="u-shape"):
        CloudRuntime(cfg).start()
