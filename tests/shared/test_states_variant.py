"""Manifest.states_variant: the prefix keys' edge variant names the graphs that compute the states, so two int8
fronts of one split made by different recipes never share cloud KV or edge activation-cache blocks."""

from __future__ import annotations

from shared.manifest import Artifact, Manifest
from shared.prefix_keys import KeyScope, block_keys


def _manifest(**artifacts: str) -> Manifest:
    arts = {"cloud/back.safetensors": Artifact("c" * 64, 1, "cloud")}
    arts.update({path: Artifact(sha, 1, "edge") for path, sha in artifacts.items()})
    m = Manifest(format_version=1, source="x", source_identity="preset:x", architecture="llama", model_type="llama",
                 split_layer=2, num_layers=4, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, vocab_size=32,
                 rope={}, eos_token_ids=[1], edge_quant="int8", edge_dtype="float32", cloud_dtype="float32",
                 artifacts=arts)
    m.bundle_id = m.compute_bundle_id()
    return m


def test_other_front_weights_are_another_variant_under_the_same_bundle():
    a = _manifest(**{"edge/front.onnx": "a" * 64})
    b = _manifest(**{"edge/front.onnx": "b" * 64})
    assert a.bundle_id == b.bundle_id and a.edge_variant == b.edge_variant == "int8"  # same cloud half, same name
    assert a.states_variant != b.states_variant and a.states_variant.startswith("int8#")
    ids = list(range(4, 40))
    assert not set(block_keys(ids, KeyScope(a.bundle_id, a.states_variant, "fp16"), 16)) \
        & set(block_keys(ids, KeyScope(b.bundle_id, b.states_variant, "fp16"), 16))


def test_encoders_count_and_drafters_do_not():
    base = {"edge/front.onnx": "a" * 64}
    plain = _manifest(**base).states_variant
    assert _manifest(**base, **{"edge/draft_head.onnx": "d" * 64}).states_variant == plain  # proposes, never computes
    assert _manifest(**base, **{"edge/vision.onnx": "v" * 64}).states_variant != plain  # its rows are states
    assert _manifest(**base, **{"edge/front_prefill.onnx": "p" * 64}).states_variant != plain


def test_the_protocol_doc_names_every_edge_variant_suffix():
    """docs/protocol.md ("Prefix keys") is all a client in another language has to derive the keys' edge variant
    from: it named `+fp32-prefill` but not `+int8-kv` (`split --edge-kv int8`), so such a client's keys never
    matched the reference edge's blocks of the same tenant."""
    from pathlib import Path
    row = next(line for line in (Path(__file__).parents[2] / "docs" / "protocol.md").read_text().splitlines()
               if line.startswith("| `edge_variant` |"))
    for report in ({"prefill": {"mode": "fp32"}}, {"kv_cache": "int8 PER_CHANNEL"},
                   {"prefill": {"mode": "fp32"}, "kv_cache": "int8 PER_CHANNEL"}):
        m = _manifest(**{"edge/front.onnx": "a" * 64})
        m.quant_report = report
        suffix = m.edge_variant[len(m.edge_quant):]
        assert suffix and f"`{suffix}`" in row, (report, suffix)
    assert "else `+int8-kv`" in row  # the prefill suffix wins when both apply
