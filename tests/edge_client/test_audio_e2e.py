"""Audio through the real server: a tiny GLM-4.1V bundle with the tiny random Whisper encoder attached, served
by ``autoglm-cloud serve``; the edge computes log-mel features and the encoder rows on the device.

* an ``input_audio`` part through :class:`EdgeClient` gives the greedy tokens of a PyTorch reference
  (encoder + projector + the unsplit LM on the same features);
* the local OpenAI endpoint takes the same part: the same answer, usage counts the audio tokens;
* a phone's 44.1 / 48 kHz recording is resampled on the device: the 16 kHz recording's answer;
* bad audio is a clear EdgeClientError / 400 and the next request is served.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from media_support import audio_reference, tone, voice, wav

from edge_client.client import EdgeClient
from edge_client.config import RetryPolicy
from edge_client.demo import LocalCloud
from edge_client.errors import EdgeClientError
from partition_tools.export_audio import tiny_audio_encoder

N_NEW = 16
RETRY = RetryPolicy(connect_timeout_s=5.0, reply_timeout_s=60.0, max_retries=5, backoff_initial_s=0.1,
                    backoff_max_s=0.5)


@pytest.fixture(scope="module")
def cloud(tiny_glm4v_audio_bundle, tmp_path_factory):
    with LocalCloud(tiny_glm4v_audio_bundle, log_path=tmp_path_factory.mktemp("log") / "cloud.log") as c:
        yield c


def _messages(clip: bytes) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": "what does it say? "},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"}}]}]


def test_input_audio_through_the_real_server(tiny_glm4v_lm, tiny_glm4v_audio_bundle, cloud):
    from fastapi.testclient import TestClient

    from edge_client.local_api import create_app

    clip = wav(tone(0.9))
    with EdgeClient(tiny_glm4v_audio_bundle, cloud.ws_url, codec="fp16", retry=RETRY) as c:
        gen = c.complete(messages=_messages(clip), max_tokens=N_NEW)
        media = gen.spec.media
        n = media.tokens_by_kind["audio"]
        assert n == c.media.audio.spec.tokens_for(int(0.9 * 16000)) and gen.stats.audio_tokens == n
        # the reference: the preset's encoder + projector in PyTorch on the same features -> the unsplit LM
        encoder, projector, _ = tiny_audio_encoder(64)
        features = c.media.audio.prepare(clip).features
        with torch.no_grad():
            rows = projector(encoder(torch.from_numpy(features)).last_hidden_state[0])[:n]
        ref_tokens, _ = audio_reference(tiny_glm4v_lm.model, media.ids, media.mask, rows, N_NEW - 1)
        assert gen.token_ids == ref_tokens

        with pytest.raises(EdgeClientError) as e:
            c.complete(messages=_messages(wav(np.zeros(8000, np.float32))), max_tokens=4)
        assert e.value.code == "silent_audio"
        assert c.complete(messages=_messages(clip), max_tokens=N_NEW).token_ids == ref_tokens  # served next

        http = TestClient(create_app(c), base_url="http://127.0.0.1")  # a loopback Host (not testserver: 403)
        body = {"model": "m", "max_tokens": N_NEW, "temperature": 0, "messages": _messages(clip)}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == gen.text
        assert r.json()["usage"]["prompt_tokens_details"]["audio_tokens"] == n
        bad = http.post("/v1/chat/completions", json={**body, "messages": _messages(wav(tone(0.5, 2000), 2000))})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_sample_rate"
        assert http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] == gen.text


def test_a_phones_48_khz_recording_gets_the_answer_of_its_16_khz_version(tiny_glm4v_audio_bundle, cloud):
    """A WAV at 44.1 or 48 kHz (what a phone records) was refused, bad_sample_rate 'resample first': the phone
    resamples it to the encoder's 16 kHz. One sound recorded at 48, 44.1 and 16 kHz: the encoder's rows within 2 %
    (max abs error over abs max) of the 16 kHz recording's, the same audio tokens and greedy answer through the real
    server, the same text from the local endpoint (autoglm-edge serve's app on uvicorn); a 2 kHz WAV is still a 400
    bad_sample_rate."""
    import httpx
    from local_server import local_server

    from edge_client.local_api import create_app

    clips = {rate: wav(voice(0.9, rate), rate) for rate in (16000, 48000, 44100)}
    with EdgeClient(tiny_glm4v_audio_bundle, cloud.ws_url, codec="fp16", retry=RETRY) as c:
        enc = c.media.audio
        rows = {rate: enc.encode(enc.prepare(clip)) for rate, clip in clips.items()}  # [n, H] each
        gens = {rate: c.complete(messages=_messages(clip), max_tokens=N_NEW) for rate, clip in clips.items()}
        for rate in (48000, 44100):
            assert np.abs(rows[rate] - rows[16000]).max() < 0.02 * np.abs(rows[16000]).max(), rate
            assert gens[rate].stats.audio_tokens == gens[16000].stats.audio_tokens > 0
            assert gens[rate].token_ids == gens[16000].token_ids, rate

        body = {"model": "m", "max_tokens": N_NEW, "temperature": 0, "messages": _messages(clips[48000])}
        with local_server(create_app(c)) as base:
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == gens[16000].text
            bad = httpx.post(base + "/v1/chat/completions", timeout=60,
                             json={**body, "messages": _messages(wav(tone(0.5, 2000), 2000))})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_sample_rate"
        assert "4000..384000 Hz" in bad.json()["error"]["message"]


def test_one_source_is_one_clip_not_a_sequence_of_sources(tiny_glm4v_audio_bundle, cloud):
    """``audio=`` / ``images=`` take one source as well as a list: a data: URL string was iterated as characters
    (refused as local paths) and bytes as integers."""
    clip = wav(tone(0.9))
    with EdgeClient(tiny_glm4v_audio_bundle, cloud.ws_url, codec="fp16", retry=RETRY) as c:
        prompt = "what does it say? " + c._placeholder("audio")
        listed = c.complete(prompt=prompt, audio=[clip], max_tokens=4)
        url = "data:audio/wav;base64," + base64.b64encode(clip).decode()
        for one in (clip, url):
            gen = c.complete(prompt=prompt, audio=one, max_tokens=4)
            assert gen.token_ids == listed.token_ids and gen.stats.audio_tokens == listed.stats.audio_tokens > 0
