"""Audio inputs and the PyTorch audio reference shared by the encoder tests (partition_tools) and the
end-to-end ones (edge_client): a noisy tone, one band-limited sound at any sample rate, their PCM WAV bytes, and
the greedy run of encoder rows placed at their placeholders -> the unsplit LM."""

from __future__ import annotations

import io
import wave

import numpy as np


def tone(seconds: float, rate: int = 16000, seed: int = 0) -> np.ndarray:
    """float32 [seconds * rate]: a 440 Hz tone with a little noise (not silence)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 440 * t) + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


def voice(seconds: float, rate: int, top: float = 7000.0) -> np.ndarray:
    """float32 [seconds * rate]: one band-limited sound at any sample rate (harmonics of 180 Hz below ``top``, random
    phases, faded in and out over 20 ms): a recording of it at 48 kHz and one at 16 kHz hold the same signal."""
    t = np.arange(round(seconds * rate)) / rate
    f = 180.0 * np.arange(1, int(top // 180) + 1)
    phase = np.random.default_rng(1).uniform(0, 2 * np.pi, f.size)
    x = ((0.3 / np.arange(1, f.size + 1))[:, None] * np.sin(2 * np.pi * f[:, None] * t + phase[:, None])).sum(0)
    fade = 0.5 - 0.5 * np.cos(np.pi * np.clip(np.minimum(t, t[-1] - t) / 0.02, 0, 1))
    return (0.5 * x * fade / np.abs(x).max()).astype(np.float32)


def wav(x: np.ndarray, rate: int = 16000) -> bytes:
    """16-bit mono PCM WAV bytes of ``x`` (clipped to [-1, 1])."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def audio_reference(model, ids: list[int], mask: np.ndarray, rows, steps: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and logits [steps + 1, V] of the unsplit ``model`` (a Glm4vForConditionalGeneration)
    over ``ids`` whose embeddings at ``mask`` (bool [S]) are replaced by ``rows`` (torch [n, H]): the prefill,
    then ``steps`` decode steps (no KV cache: every step recomputes the whole sequence)."""
    import torch

    emb_table = model.get_input_embeddings()
    seq, tokens, logits = list(ids), [], []
    with torch.no_grad():
        for _ in range(steps + 1):
            x = emb_table(torch.tensor([seq]))
            m = torch.tensor(mask.tolist() + [False] * (len(seq) - len(ids)))
            x[0, m] = rows
            out = model(inputs_embeds=x, use_cache=False).logits[0, -1]
            logits.append(out.numpy())
            tokens.append(int(out.argmax()))
            seq.append(tokens[-1])
    return tokens, np.stack(logits)
