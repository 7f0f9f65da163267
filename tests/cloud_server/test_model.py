"""cloud_server.model: int8 weight-only layers, full-model mode over GLM-4.1V's 3-D RoPE, the plain-model fallback."""

from __future__ import annotations

import pytest
import torch
from cloud_support import greedy_reference

from cloud_server.config import EngineConfig
from cloud_server.engine.llm_engine import LLMEngine
from cloud_server.engine.sampling_params import SamplingParams
from cloud_server.engine.sequence import InputChunk
from cloud_server.model import Int8Linear, compute_dtype, load_full_model, load_split_model, quantize_int8_
from partition_tools.cloud_half import CloudModel


def test_int8_linear_is_close_and_stores_int8():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=True)
    q = Int8Linear(lin)
    assert q.qweight.dtype == torch.int8 and q.scale.shape == (32,)
    x = torch.randn(5, 64)
    ref = lin(x)
    err = (q(x) - ref).abs().max() / ref.abs().max()
    assert 0 < err < 0.02  # really quantized, and close
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(4, 2)))
    assert quantize_int8_(m) == 2 and isinstance(m[2][0], Int8Linear)


def test_compute_dtypes():
    assert compute_dtype("fp32", "cpu") == torch.float32
    assert compute_dtype("int8", "cpu") == torch.float32 and compute_dtype("int8", "cuda") == torch.bfloat16
    assert compute_dtype("bf16", "cuda") == torch.bfloat16


def test_split_model_outside_an_engine_step_is_the_plain_back_half(tiny_bundle):
    """The registered attention falls back to SDPA: the served model is still the reference back half."""
    plain = CloudModel.from_bundle(tiny_bundle)
    ours = load_split_model(tiny_bundle, "fp32")
    assert ours.config._attn_implementation == "autoglm_paged" and ours.variant == "fp32"
    assert plain.config._attn_implementation == "sdpa"
    h = torch.randn(1, 7, 64)
    pos = torch.arange(7)[None]
    torch.testing.assert_close(ours(h, pos), plain(h, pos), rtol=1e-5, atol=1e-5)


def test_int8_variant_quantizes_the_layers_only(tiny_bundle):
    model = load_split_model(tiny_bundle, "int8")
    assert any(isinstance(m, Int8Linear) for m in model.layers.modules())
    assert type(model.lm_head) is torch.nn.Linear and model.dtype == torch.float32


@pytest.fixture(scope="module")
def glm4v():
    from partition_tools.models import load_model

    return load_model("tiny-glm4v")


def test_full_mode_glm4v_text_greedy_matches(glm4v):
    eng = LLMEngine.from_models(EngineConfig(num_blocks=32, block_size=4),
                                {"fp32": load_full_model(glm4v, "fp32")})
    prompt = [5, 17, 99, 240, 31, 8]
    eng.add_request("r", InputChunk(0, token_ids=torch.tensor(prompt)), SamplingParams(0.0, max_tokens=8))
    got = []
    while eng.seqs:
        got += [o.token_id for o in eng.step() if o.token_id is not None]
    assert got == greedy_reference(glm4v.model, prompt, 8, [2, 3])


def test_multimodal_rope_positions_reach_the_rotary_embedding(glm4v):
    """3-D positions (as an image's tokens have) give the library's logits for those positions."""
    model = load_full_model(glm4v, "fp32")
    eng = LLMEngine.from_models(EngineConfig(num_blocks=32, block_size=4, async_scheduling=False), {"fp32": model})
    ids = torch.tensor([5, 17, 99, 240, 31, 8])
    rope = torch.stack([torch.tensor([0, 1, 2, 2, 2, 5]), torch.tensor([0, 1, 2, 3, 3, 5]),
                        torch.tensor([0, 1, 2, 2, 3, 5])])  # [3, 6]: a 2x2 "image" at positions 2-4
    lm = glm4v.model.model.language_model
    with torch.no_grad():
        hidden = lm(input_ids=ids[None], position_ids=rope[:, None]).last_hidden_state[0, -1]
        ref = torch.log_softmax(glm4v.model.lm_head(hidden), -1)
    eng.add_request("r", InputChunk(0, token_ids=ids, rope_positions=rope), SamplingParams(0.0, max_tokens=1, logprobs=3))
    [out] = eng.step()
    top = torch.topk(ref, 3)
    assert [t for t, _ in out.top_logprobs] == top.indices.tolist()
    assert abs(out.logprob - float(top.values[0])) < 1e-4
    # ... and they matter: 1-D positions give other numbers
    eng.add_request("s", InputChunk(0, token_ids=ids), SamplingParams(0.0, max_tokens=1, logprobs=3))
    [plain] = eng.step()
    assert abs(plain.logprob - out.logprob) > 1e-6


def test_rope_positions_for_a_1d_rope_model_are_refused(tiny_bundle):
    eng = LLMEngine.from_models(EngineConfig(num_blocks=16, block_size=4),
                                {"fp32": load_split_model(tiny_bundle, "fp32")})
    [err] = eng.add_request("r", InputChunk(0, hidden=torch.randn(2, 64), rope_positions=torch.zeros(3, 2).long()),
                            SamplingParams())
    assert err.error_code == "bad_input" and "multimodal" in err.error_message
