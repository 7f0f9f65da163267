"""Several bundles in one server (cloud_server/bundle_set.py): tiny-glm4 split at layer 2 and at layer 1 side
by side, each edge served by its own engine with the unsplit model's tokens; an unknown bundle refused with
every served id; one merged /metrics; /ready and /v1/models over both."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from model_support import hf_greedy
from cloud_support import ServerThread
from prometheus_client.parser import text_string_to_metric_families

from cloud_server.app import create_app
from cloud_server.config import ConfigError, EngineConfig, ServerConfig
from cloud_server.runtime import CloudRuntime
from edge_client.client import EdgeClient
from edge_client.config import RetryPolicy
from edge_client.transport import HandshakeRefused, Link
from shared import protocol as P
from shared.manifest import Manifest

PROMPT = list(range(5, 45))
N_NEW = 8
RETRY = RetryPolicy(connect_timeout_s=5.0, reply_timeout_s=30.0, max_retries=2, backoff_initial_s=0.1)


@pytest.fixture(scope="module")
def bundle_l1(tiny_glm4_l1_bundle):
    return tiny_glm4_l1_bundle  # tiny-glm4 split at layer 1, fp32 edge (tests/conftest.py)


@pytest.fixture(scope="module")
def two_bundles(tiny_bundle, bundle_l1, tiny_glm4_int8_bundle):
    cfg = ServerConfig(bundle=tiny_bundle, more_bundles=(bundle_l1, tiny_glm4_int8_bundle), drain_timeout_s=0.1,
                       engine=EngineConfig(device="cpu"))
    with ServerThread(create_app(CloudRuntime(cfg), owns_runtime=True)) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(tiny_lm):
    return hf_greedy(tiny_lm.model, PROMPT, N_NEW)


def test_each_bundle_has_its_engine_and_the_right_tokens(two_bundles, tiny_bundle, bundle_l1, tiny_glm4_int8_bundle,
                                                         reference):
    for bundle in (tiny_bundle, bundle_l1, tiny_glm4_int8_bundle, tiny_bundle):  # interleaved on one server
        with EdgeClient(bundle, two_bundles.ws_url, codec="fp16", retry=RETRY) as c:
            got = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW).token_ids
        if bundle is tiny_glm4_int8_bundle:  # the int8 edge of the layer-2 bundle: its engine, its accuracy
            assert len(got) == N_NEW
        else:
            assert got == reference, bundle
    rts = two_bundles.server.app.state.split.all_runtimes
    assert len(rts) == 2 and rts[0].engine is not rts[1].engine
    assert {rt.manifest.split_layer for rt in rts} == {1, 2}


def test_an_unknown_bundle_is_refused_with_every_served_id(two_bundles, tiny_bundle, bundle_l1):
    link = Link(two_bundles.ws_url, None, RETRY)
    with pytest.raises(HandshakeRefused) as ei:
        asyncio.run(link.connect(P.Hello(bundle_id="f" * 32, codecs=["fp16"])))
    ids = [Manifest.load(tiny_bundle).bundle_id, Manifest.load(bundle_l1).bundle_id]
    assert ei.value.code == "bundle_mismatch" and ei.value.bundle_ids == ids
    assert all(i in str(ei.value) for i in ids), str(ei.value)  # the words named the default bundle alone


def test_ready_models_listing_and_one_merged_metrics_page(two_bundles, tiny_bundle, bundle_l1):
    base = two_bundles.url
    ready = httpx.get(f"{base}/ready").json()
    assert ready["ready"] and len(ready["bundle_ids"]) == 2
    names = [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]]
    assert len(names) == 2 and len(set(names)) == 2  # both directories are called "b": told apart by id
    listing = httpx.get(f"{base}/v1/bundles").json()["data"]
    assert [b["split_layer"] for b in listing] == [2, 1]
    assert [v["edge_quant"] for v in listing[0]["edge_variants"]] == ["fp32", "int8"]
    text = httpx.get(f"{base}/metrics").text
    helps = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")]
    assert "vllm:generation_tokens_total" in helps and len(helps) == len(set(helps))  # each family once
    families = {f.name for f in text_string_to_metric_families(text)}  # a valid exposition
    assert "vllm:generation_tokens" in families
    for name in names:
        assert f'vllm:generation_tokens_total{{model_name="{name}"}}' in text


def test_tensor_parallel_serves_one_bundle_per_process(tiny_bundle, bundle_l1):
    cfg = ServerConfig(bundle=tiny_bundle, more_bundles=(bundle_l1,), engine=EngineConfig(device="cpu", tp=2))
    with pytest.raises(ConfigError, match="tensor parallelism"):
        create_app(CloudRuntime(cfg))


def test_serve_takes_several_bundle_directories(tmp_path, tiny_bundle, bundle_l1, capsys):
    from cloud_server.cli import build_parser, main, resolve

    cfg = resolve(build_parser().parse_args(["serve", str(tiny_bundle), str(bundle_l1), "--device", "cpu"]), {})
    assert cfg.bundle == tiny_bundle and cfg.more_bundles == (bundle_l1,)
    assert main(["serve", str(tiny_bundle), str(tmp_path)]) == 2
    assert f"{tmp_path}: not a bundle" in capsys.readouterr().err
