"""The scripted fake server (``python -m tests.protocol_fake_server``) as a client in another language would
use it: started as a process, driven with raw frames; it follows its documented script and refuses what the
rulebook refuses, with the documented codes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import websockets

from shared import codecs as C
from shared import protocol as P

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = 8


@pytest.fixture(scope="module")
def fake_url():
    proc = subprocess.Popen([sys.executable, "-m", "tests.protocol_fake_server", "--port", "0", "--bundle-id",
                             "demo-bundle", "--hidden-size", str(HIDDEN), "--block-size", "4", "--eos", "0"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("ws://127.0.0.1:") and url.endswith("/v1/split"), url
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def onehot(tokens: list[int]) -> np.ndarray:
    x = np.zeros((len(tokens), HIDDEN), np.float32)  # [n, H]: row i's largest value at tokens[i]
    x[np.arange(len(tokens)), tokens] = 1.0
    return x


async def _session(url: str):
    ws = await websockets.connect(url)
    await ws.send(P.encode_message(P.Hello(bundle_id="demo-bundle", codecs=["int8-b32", "fp16"])))
    welcome = P.decode_message(await ws.recv())
    return ws, welcome


def test_the_script_answers_argmax_of_the_last_row(fake_url):
    fp16 = C.get_codec("fp16")

    async def main():
        ws, welcome = await _session(fake_url)
        await ws.send(P.encode_message(P.Prefill(request_id="r1", start=0, hidden=fp16.encode(onehot([1, 2, 5])),
                                                 params=P.SamplingParams(max_tokens=3), prefix_keys=[])))
        first = P.decode_message(await ws.recv())
        await ws.send(P.encode_message(P.DecodeStep(request_id="r1", position=3, hidden=fp16.encode(onehot([6])))))
        second = P.decode_message(await ws.recv())
        await ws.send(P.encode_message(P.DecodeStep(request_id="r1", position=4, hidden=fp16.encode(onehot([0])))))
        third = P.decode_message(await ws.recv())  # token 0 is --eos
        await ws.close()
        return welcome, first, second, third

    welcome, first, second, third = asyncio.run(main())
    assert welcome.codecs == ["int8-b32", "fp16"] and welcome.limits.prefix_block_tokens == 4
    assert (first.index, first.token_ids, first.finish_reason) == (0, [5], None)
    assert (second.index, second.token_ids, second.finish_reason) == (1, [6], None)
    assert (third.token_ids, third.finish_reason, third.usage.prompt_tokens) == ([0], "stop", 3)


def test_the_fake_enforces_the_rulebook(fake_url):
    fp16 = C.get_codec("fp16")

    async def main():
        ws, _ = await _session(fake_url)
        await ws.send(P.encode_message(P.DecodeStep(request_id="nope", position=0, hidden=fp16.encode(onehot([1])))))
        unknown = P.decode_message(await ws.recv())
        await ws.send(P.encode_message(P.Prefill(request_id="p", start=4, hidden=fp16.encode(onehot([1])),
                                                 params=P.SamplingParams(), prefix_keys=["never-published"])))
        miss = P.decode_message(await ws.recv())
        await ws.send(P.encode_message(P.Hello(bundle_id="demo-bundle", codecs=["fp16"])))
        fatal = P.decode_message(await ws.recv())
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
        return unknown, miss, fatal, closed.value.rcvd.code

    unknown, miss, fatal, code = asyncio.run(main())
    assert (unknown.code, unknown.request_id) == ("unknown_request", "nope")
    assert (miss.code, miss.request_id) == ("prefix_miss", "p")
    assert fatal.code == "bad_state" and fatal.fatal and code == 1002


def test_other_paths_have_no_split_endpoint(fake_url):
    async def main():
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(fake_url.replace("/v1/split", "/v2/other"))
        return refused.value.response.status_code

    assert asyncio.run(main()) == 404


def test_the_fake_closes_as_the_real_server_does(fake_url):
    """protocol.md: the scripted server refuses "with the real server's rulebook ... same codes"; a fatal too_large
    (a msgpack array over the decoder's limit, before the Hello and after the Welcome) closed 1002, where the real
    server closes 1009 (shared.errors.fatal_close_code: one rule for both)."""
    async def fatal(hello: bool) -> tuple[str, int]:
        if hello:
            ws, _ = await _session(fake_url)
        else:
            ws = await websockets.connect(fake_url)
        await ws.send(b"\xdd\xff\xff\xff\xff\x01")  # array32 of 2^32 - 1 entries
        err = P.decode_message(await ws.recv())
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
        return err.code, closed.value.rcvd.code

    async def main():
        return [await fatal(False), await fatal(True)]

    assert asyncio.run(main()) == [("too_large", 1009)] * 2


def test_a_bundle_mismatch_names_the_served_bundle(fake_url):
    """protocol.md: Error.bundle_ids is set on bundle_mismatch (the bundles a client may download instead); the
    fake's refusal left it empty, so a foreign client's update path could not be tested against it."""
    async def main():
        ws = await websockets.connect(fake_url)
        await ws.send(P.encode_message(P.Hello(bundle_id="another-bundle", codecs=["fp16"])))
        err = P.decode_message(await ws.recv())
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
        return err, closed.value.rcvd.code

    err, code = asyncio.run(main())
    assert (err.code, err.fatal, err.bundle_ids, code) == ("bundle_mismatch", True, ["demo-bundle"], 1008)
