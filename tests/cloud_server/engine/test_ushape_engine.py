"""The engine serving a u-shape bundle's middle (``split --tail``): every computed position's hidden state goes
back (prompt chunks too), nothing is sampled, and a step that starts before the sequence's end rolls its KV back
(the edge rejected drafts); the pool's accounting returns to zero."""

from __future__ import annotations

import torch
from cloud_support import boundary, edge_front

from cloud_server.config import EngineConfig
from cloud_server.engine.llm_engine import LLMEngine
from cloud_server.engine.sampling_params import SamplingParams
from cloud_server.engine.sequence import InputChunk
from cloud_server.model import load_split_model
from partition_tools.cloud_half import CloudModel


def _drain(eng: LLMEngine) -> list:
    out = []
    while eng.has_work():
        out += eng.step()
    return out


def _states(outs) -> dict[int, torch.Tensor]:
    """position -> returned state [H]."""
    got = {}
    for o in outs:
        assert o.token_id is None and o.states is not None and o.error_code is None
        for j in range(o.states.shape[0]):
            got[o.states_start + j] = o.states[j]
    return got


def test_middle_states_for_every_position_and_rollback(tiny_glm4_ushape_bundle):
    cfg = EngineConfig(num_blocks=32, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)  # the prompt runs in 2 chunks
    eng = LLMEngine.from_models(cfg, {"fp32": load_split_model(tiny_glm4_ushape_bundle, "fp32")})
    assert eng.output_states
    front = edge_front(tiny_glm4_ushape_bundle)
    ids = torch.randint(4, 512, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    h = boundary(front, ids[:12])  # [12, H]
    eng.add_request("u", InputChunk(0, hidden=h), SamplingParams(max_tokens=8))
    got = _states(_drain(eng))
    assert sorted(got) == list(range(12))  # both prompt chunks' positions came back
    # a speculative step of 3 rows, then the edge keeps 1 and steps again from position 13
    eng.add_input("u", InputChunk(12, hidden=boundary(front, ids[12:15])))
    got.update(_states(_drain(eng)))
    eng.add_input("u", InputChunk(13, hidden=front_rows(front, ids, 13)))
    got.update(_states(_drain(eng)))
    assert eng.seqs["u"].num_computed == 14 and len(eng.seqs["u"].block_table) == 4
    reference = CloudModel.from_bundle(tiny_glm4_ushape_bundle)
    with torch.no_grad():
        full = boundary(edge_front(tiny_glm4_ushape_bundle), ids[:14])  # [14, H]
        ref = reference(full[None], torch.arange(14)[None])[0]  # [14, H]
    torch.testing.assert_close(torch.stack([got[p] for p in range(14)]), ref, atol=1e-5, rtol=1e-5)
    eng.abort("u")
    assert eng.num_used_blocks() == 0
    for bm in eng.block_managers.values():
        bm.check()


def front_rows(front, ids: list[int], position: int) -> torch.Tensor:
    """The front's state of ``ids[position]`` after rolling the front back to ``position`` as the edge does."""
    front.truncate(position)
    return boundary(front, [ids[position]])
