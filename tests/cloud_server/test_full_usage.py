"""Per-tenant usage on ``autoglm-cloud serve --full`` (``cloud_server.usage``, ``RequestMeter``): a real full-model
server with a keys file of two tenants and an operator. Its OpenAI requests were counted in no ``autoglm:tenant_*``
series (nor traced by tenant), so an operator of a --full server could not bill its tenants; each tenant's requests,
prompt and generated tokens now add up to its answers' ``usage`` fields, a stream the client closes counts the
tokens generated until then, and a request refused before the engine took it (a 400) counts nothing. (A replayed
request's prompt counts once: test_full_api_overload.py.)"""

from __future__ import annotations

import logging
import re
import time

import httpx
import openai
import pytest
from cloud_support import ServerThread

from cloud_server import auth
from cloud_server.app import create_app
from cloud_server.config import EngineConfig, ServerConfig
from cloud_server.runtime import CloudRuntime

MODEL = "tiny"


@pytest.fixture(scope="module")
def full_keyed(tiny_lm, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    keys = {t: auth.add_key(path, t)[1] for t in ("alice", "bob")}
    keys["ops"] = auth.add_key(path, "ops", role="operator")[1]  # reads /metrics
    rt = CloudRuntime(ServerConfig(full="tiny-glm4", keys_file=path, open_probes=False, model_name=MODEL,
                                   engine=EngineConfig(num_blocks=512, block_size=4, max_model_len=1024)),
                      loaded=tiny_lm).start()
    try:
        with ServerThread(create_app(rt)) as srv:
            srv.keys = keys
            yield srv
    finally:
        rt.stop()


def _usage(srv) -> dict[tuple[str, str], float]:
    """``{(series, tenant): value}`` of the tenant series in /metrics (read with the operator's key)."""
    text = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {srv.keys['ops']}"}).text
    found = re.findall(r'^autoglm:tenant_(\w+)_total\{model_name="tiny",tenant="(\w+)"\} (\S+)$', text, re.M)
    return {(series, tenant): float(v) for series, tenant, v in found}


def _client(srv, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.keys[tenant], max_retries=0, timeout=60)


def test_each_tenants_requests_and_tokens_are_its_answers_usage(full_keyed, caplog):
    before = _usage(full_keyed)
    alice, bob = _client(full_keyed, "alice"), _client(full_keyed, "bob")
    with caplog.at_level(logging.INFO, logger="autoglm.cloud.trace"):
        answers = {"alice": [alice.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=5, temperature=0)],
                   "bob": [bob.completions.create(model=MODEL, prompt=[9, 8, 7, 6, 5, 4], max_tokens=3)]}
        chunks = list(alice.completions.create(model=MODEL, prompt=[11, 12, 13, 14], max_tokens=7, stream=True,
                                               stream_options={"include_usage": True}))
        answers["alice"].append(chunks[-1])  # the usage-only chunk
        with pytest.raises(openai.BadRequestError):  # refused before the engine took it: no request, no tokens
            bob.completions.create(model=MODEL, prompt=[10 ** 6], max_tokens=3)
    after = _usage(full_keyed)
    for tenant, got in answers.items():
        spent = {"requests": len(got), "prompt_tokens": sum(a.usage.prompt_tokens for a in got),
                 "generation_tokens": sum(a.usage.completion_tokens for a in got)}
        assert {k: after.get((k, tenant), 0) - before.get((k, tenant), 0) for k in spent} == spent, tenant
    assert after.get(("requests", "unkeyed"), 0) == before.get(("requests", "unkeyed"), 0)
    lines = [r.getMessage() for r in caplog.records if r.name == "autoglm.cloud.trace"]
    assert len(lines) == 6, lines  # an open and a finish line for each of the three requests the engine took
    assert sum(bool(re.fullmatch(r"trace=req-\w+ tenant=alice open prompt=[34]", m)) for m in lines) == 2, lines
    assert any(re.fullmatch(r"trace=req-\w+ tenant=bob finish=length tokens=3", m) for m in lines), lines


def test_a_stream_the_client_closes_counts_the_tokens_generated_until_then(full_keyed, caplog):
    before = _usage(full_keyed).get(("generation_tokens", "bob"), 0)
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 1000, "temperature": 0.0, "stream": True}
    with caplog.at_level(logging.INFO, logger="autoglm.cloud.trace"):
        with httpx.stream("POST", full_keyed.url + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {full_keyed.keys['bob']}"}) as r:
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: {")
                if events == 3:
                    break  # the client goes: the server cancels the rest
        deadline, ended = time.monotonic() + 30, []
        while not ended:
            assert time.monotonic() < deadline, "no finish line"
            ended = [m for r in caplog.records if (m := r.getMessage()).startswith("trace=") and "tenant=bob finish="
                     in m]
            time.sleep(0.05)
    (line,) = ended
    tokens = int(line.rsplit("tokens=", 1)[1])
    assert "finish=cancelled" in line and 3 <= tokens < 1000, line
    assert _usage(full_keyed)[("generation_tokens", "bob")] - before == tokens
