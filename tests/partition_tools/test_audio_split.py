"""An attached audio encoder (tiny random Whisper + projector): log-mel on the edge, the encoder's ONNX, the
front with the audio rows at the placeholders, the cloud half -> the same greedy tokens (prefill + 16 decode
steps) as a PyTorch reference of encoder + projector + the unsplit LM fed the same features."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from media_support import audio_reference, tone, wav

from edge_client.audio import AUDIO, AUDIO_CONFIG, AudioEncoder, log_mel, prepare_audio
from edge_client.front import FrontRuntime
from edge_client.media import MediaItem, assemble
from edge_client.vision import MediaError
from partition_tools.cloud_half import CloudModel
from partition_tools.export_audio import (TINY_PRESET, AudioEncoderError, load_audio_encoder, save_audio_encoder,
                                          tiny_audio_encoder)

DECODE_STEPS = 16
VOCAB = 1000  # an LM vocabulary holding the preset's audio token (16)


def test_features_match_whisper_feature_extractor(tiny_glm4v_audio_bundle):
    from transformers import WhisperFeatureExtractor

    spec = AudioEncoder(tiny_glm4v_audio_bundle).spec
    x = tone(1.3)
    ref = WhisperFeatureExtractor(feature_size=spec.n_mels, chunk_length=spec.max_samples // spec.sample_rate)(
        x, sampling_rate=16000, return_tensors="np").input_features
    assert np.abs(log_mel(x, spec) - ref).max() <= 1e-4  # measured 8.7e-6: the extractor's float32 spectrogram
    # the same computation in float64 (transformers' spectrogram): equal to float32 rounding
    from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

    padded = np.zeros(spec.max_samples)
    padded[:x.size] = x
    bank = mel_filter_bank(num_frequency_bins=1 + spec.n_fft // 2, num_mel_filters=spec.n_mels, min_frequency=0.0,
                           max_frequency=8000.0, sampling_rate=spec.sample_rate, norm="slaney", mel_scale="slaney")
    exact = spectrogram(padded, window_function(spec.n_fft, "hann"), frame_length=spec.n_fft, hop_length=spec.hop_length,
                        power=2.0, mel_filters=bank, log_mel="log10", dtype=np.float64)[:, :-1]  # [n_mels, window_frames]
    exact = (np.maximum(exact, exact.max() - 8.0) + 4.0) / 4.0
    assert np.abs(log_mel(x, spec)[0] - exact).max() <= 1e-6


def test_bundle_carries_the_encoder(tiny_glm4v_audio_bundle):
    import json

    m = json.loads((tiny_glm4v_audio_bundle / "manifest.json").read_text())
    assert m["artifacts"][AUDIO]["role"] == "edge" and m["artifacts"][AUDIO_CONFIG]["role"] == "edge"
    assert m["quant_report"]["audio"]["encoder"] == TINY_PRESET


def test_a_checkpoint_directory_round_trips(tmp_path):
    from transformers import WhisperConfig, WhisperModel

    enc, proj, pcfg = tiny_audio_encoder(64)
    whole = WhisperModel(WhisperConfig(**{**enc.config.to_dict()}))
    whole.encoder.load_state_dict(enc.state_dict())
    save_audio_encoder(whole, proj, pcfg, tmp_path / "enc")
    enc2, proj2, _ = load_audio_encoder(tmp_path / "enc", 64, VOCAB)
    feats = torch.randn(1, 80, 200)
    with torch.no_grad():
        np.testing.assert_allclose(proj2(enc2(feats).last_hidden_state[0]).numpy(),
                                   proj(enc(feats).last_hidden_state[0]).numpy(), atol=1e-6)
    with pytest.raises(AudioEncoderError, match="hidden size"):
        load_audio_encoder(tmp_path / "enc", 128, VOCAB)
    with pytest.raises(AudioEncoderError, match="projector.json"):
        load_audio_encoder(tmp_path, 64, VOCAB)


def test_a_projector_config_the_lm_or_the_encoder_cannot_use_is_refused(tmp_path):
    """projector.json was taken as written: an audio_token_id outside the LM's vocabulary (or negative) made a bundle
    whose every audio request failed bad_media ('1 media input(s) without a placeholder', the app blamed), and a
    pool that does not divide the encoder's frames or a value that is no integer ended split in a traceback. Each
    is an AudioEncoderError (split: exit 2) naming the field."""
    import json

    from transformers import WhisperConfig, WhisperModel

    from partition_tools.export_audio import Projector

    enc, proj, pcfg = tiny_audio_encoder(64)
    whole = WhisperModel(WhisperConfig(**{**enc.config.to_dict()}))
    whole.encoder.load_state_dict(enc.state_dict())
    cases = [({"audio_token_id": VOCAB}, proj, "audio_token_id 1000 is not a token"),
             ({"audio_token_id": -1}, proj, "audio_token_id -1 is not a token"),
             ({"audio_token_id": "16"}, proj, "audio_token_id must be an integer"),
             ({"pool": 0}, proj, "pool 0 does not divide the encoder's 100 frames"),
             ({"pool": 3}, Projector(32, 64, 3), "pool 3 does not divide the encoder's 100 frames"),
             ({"pool": 4}, proj, "projector.safetensors: size mismatch for proj1.weight")]
    for i, (change, projector, message) in enumerate(cases):
        d = save_audio_encoder(whole, projector, {**pcfg, **change}, tmp_path / str(i))
        with pytest.raises(AudioEncoderError) as e:
            load_audio_encoder(d, 64, VOCAB)
        assert message in str(e.value) and "\n" not in str(e.value), e.value
    (d / "projector.json").write_text("{pool: 2")
    with pytest.raises(AudioEncoderError, match="projector.json: not JSON"):
        load_audio_encoder(d, 64, VOCAB)
    (d / "projector.json").write_text(json.dumps(pcfg))
    (d / "projector.safetensors").unlink()
    save_audio_encoder(whole, proj, {**pcfg, "pool": 2}, d)
    assert load_audio_encoder(d, 64, VOCAB)[2] == pcfg  # a valid one still loads


@torch.no_grad()
def test_split_matches_reference(tiny_glm4v_lm, tiny_glm4v_audio_bundle):
    enc_edge = AudioEncoder(tiny_glm4v_audio_bundle)
    spec = enc_edge.spec
    clip = enc_edge.prepare(wav(tone(0.9)))
    rows = enc_edge.encode(clip)  # [n, H]
    assert rows.shape == (clip.n_tokens, 64) and clip.n_tokens == spec.tokens_for(int(0.9 * 16000))
    # the PyTorch reference: the same encoder + projector (the preset's seed) -> the unsplit LM
    encoder, projector, _ = tiny_audio_encoder(64)
    ref_rows = projector(encoder(torch.from_numpy(clip.features)).last_hidden_state[0])[: clip.n_tokens]
    assert np.abs(rows - ref_rows.numpy()).max() <= 1e-5
    ids = [20, 21, 22, spec.audio_token_id, 23, 24]
    prompt = assemble(ids, [MediaItem("audio", spec.audio_token_id, rows, clip.digest)], 64)
    assert prompt.rope_delta == 0 and prompt.tokens_by_kind == {"audio": clip.n_tokens}
    ref_tokens, ref_logits = audio_reference(tiny_glm4v_lm.model, prompt.ids, prompt.mask, ref_rows, DECODE_STEPS)
    # the split
    front, cloud = FrontRuntime(tiny_glm4v_audio_bundle, threads=1), CloudModel.from_bundle(tiny_glm4v_audio_bundle)
    hidden = [front.prefill_media(prompt.ids, None, prompt.embeds, prompt.mask)]
    tokens, logits = [], []
    for step in range(DECODE_STEPS + 1):
        h = torch.from_numpy(np.concatenate(hidden))[None]
        out = cloud(h, torch.arange(h.shape[1])[None])[0, -1]
        logits.append(out.numpy())
        tokens.append(int(out.argmax()))
        if step < DECODE_STEPS:
            hidden.append(front.decode(tokens[-1]))
    err = float(np.abs(np.stack(logits) - ref_logits).max())
    print(f"audio ({clip.n_tokens} tokens): max abs logit error {err:.2e} over {DECODE_STEPS + 1} steps")
    assert tokens == ref_tokens and err <= 1e-4


@pytest.mark.parametrize("make,code", [
    (lambda: wav(np.zeros(8000, np.float32)), "silent_audio"),
    (lambda: wav(np.zeros(0, np.float32)), "bad_audio"),
    (lambda: wav(tone(0.5, 3000), 3000), "bad_sample_rate"),  # below the resampler's 4 kHz floor
    (lambda: wav(tone(3.0)), "audio_too_long"),  # the tiny encoder's window is 2 s
    (lambda: b"RIFF\x00\x00\x00\x00WAVEjunk", "bad_audio"),
    (lambda: b"ID3\x03\x00" + bytes(100), "bad_audio"),  # an mp3: not a PCM WAV
])
def test_bad_audio_is_refused_and_the_next_clip_is_served(tiny_glm4v_audio_bundle, make, code):
    enc = AudioEncoder(tiny_glm4v_audio_bundle)
    with pytest.raises(MediaError) as e:
        enc.prepare(make())
    assert e.value.code == code
    assert enc.encode(enc.prepare(wav(tone(0.4)))).shape[1] == 64


def test_encoders_load_on_first_use(tiny_glm4v_audio_bundle):
    enc = AudioEncoder(tiny_glm4v_audio_bundle)
    assert not enc.loaded
    assert enc.warmup() > 0 and enc.loaded
    assert prepare_audio(tone(0.2), 16000, enc.spec).n_tokens == enc.spec.tokens_for(3200)
