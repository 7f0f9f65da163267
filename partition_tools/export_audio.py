"""An audio encoder for the edge: a Whisper-style encoder + a projector into the LM's hidden size, as ONNX.

GLM-4.1V ships no audio encoder; ``split --audio-encoder DIR`` attaches one. ``DIR`` is a checkpoint
directory holding

* ``config.json`` + weights of a Whisper model (``WhisperModel`` / ``WhisperForConditionalGeneration``
  layout: a real Whisper checkpoint works unchanged; only its encoder is used);
* ``projector.json`` (``{"pool": k, "hidden_size": H, "audio_token_id": id}``) and ``projector.safetensors``
  (``proj1.*``, ``proj2.*``): ``k`` consecutive encoder frames are stacked and mapped by
  ``Linear(k d, H) -> GELU -> Linear(H, H)`` (the Qwen2-Audio / LLaVA-style adapter); ``k`` must divide the encoder's
  frames a window, ``id`` be a token of the LM's vocabulary (:class:`AudioEncoderError` otherwise).

The preset name ``tiny-whisper`` instead builds a random 2-layer encoder and projector (tests, benchmarks):
its outputs carry no meaning, and neither would any projector not trained against this LM.

Graph (one window of the encoder's fixed length ``F`` mel frames; the edge pads shorter clips, as Whisper
does, and keeps the rows that cover the clip)::

    inputs   input_features  float32 [1, n_mels, F]   log-mel (edge_client.audio.log_mel)
    outputs  audio_embeds    float32 [F / (2 k), H]   one row per audio placeholder token

``edge/audio.json`` holds what the edge needs (sample rate, mel parameters, window, pool, token id).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

from edge_client.audio import AUDIO, AUDIO_CONFIG, AudioSpec

TINY_PRESET = "tiny-whisper"
TINY_AUDIO_TOKEN = 16  # a token id of the tiny LM's vocabulary that no template writes


class AudioEncoderError(ValueError):
    """The audio encoder directory cannot be used; one-line reason."""


class Projector(torch.nn.Module):
    """Stack ``pool`` frames, then Linear -> GELU -> Linear into the LM's hidden size."""

    def __init__(self, d_model: int, hidden_size: int, pool: int):
        super().__init__()
        self.pool = pool
        self.proj1 = torch.nn.Linear(d_model * pool, hidden_size)
        self.proj2 = torch.nn.Linear(hidden_size, hidden_size)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:  # [T, d] -> [T / pool, H]
        x = frames.reshape(-1, frames.shape[-1] * self.pool)
        return self.proj2(torch.nn.functional.gelu(self.proj1(x)))


class AudioTower(torch.nn.Module):
    """Whisper encoder over one window + the projector: [1, n_mels, F] -> [F / (2 pool), H]."""

    def __init__(self, encoder: torch.nn.Module, projector: Projector):
        super().__init__()
        self.encoder, self.projector = encoder, projector

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        frames = self.encoder(input_features).last_hidden_state[0]  # [F / 2, d]
        return self.projector(frames)


def tiny_audio_encoder(hidden_size: int, seed: int = 0) -> tuple[torch.nn.Module, Projector, dict]:
    """A random 2-layer Whisper encoder (2 s window) and projector for an LM of ``hidden_size``."""
    from transformers import WhisperConfig, WhisperModel

    cfg = WhisperConfig(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                        decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=64, num_mel_bins=80,
                        max_source_positions=100, vocab_size=64, max_target_positions=16, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, suppress_tokens=[],
                        begin_suppress_tokens=[])
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        encoder = WhisperModel(cfg).encoder.eval()
        proj = Projector(cfg.d_model, hidden_size, pool=2).eval()
    return encoder, proj, {"pool": 2, "hidden_size": hidden_size, "audio_token_id": TINY_AUDIO_TOKEN}


def load_audio_encoder(source: str | Path, hidden_size: int,
                       vocab_size: int) -> tuple[torch.nn.Module, Projector, dict]:
    """(encoder, projector, projector config) of a checkpoint directory or the ``tiny-whisper`` preset, for an LM of
    ``hidden_size`` and ``vocab_size`` (the audio placeholder token must be one of its tokens)."""
    if str(source) == TINY_PRESET:
        return tiny_audio_encoder(hidden_size)
    from safetensors.torch import load_file
    from transformers import WhisperModel

    d = Path(source)
    for name in ("config.json", "projector.json", "projector.safetensors"):
        if not (d / name).is_file():
            raise AudioEncoderError(f"{d}: no {name} (an audio encoder directory holds a Whisper checkpoint, "
                                    f"projector.json and projector.safetensors)")
    try:
        encoder = WhisperModel.from_pretrained(d, dtype=torch.float32).encoder.eval()
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise AudioEncoderError(f"{d}: cannot load the Whisper encoder: {type(e).__name__}: {e}".splitlines()[0]) \
            from None
    pcfg = _projector_config(d / "projector.json", hidden_size, vocab_size, int(encoder.config.max_source_positions))
    proj = Projector(int(encoder.config.d_model), hidden_size, pcfg["pool"])
    try:
        missing, unexpected = proj.load_state_dict(load_file(str(d / "projector.safetensors")), strict=False)
    except RuntimeError as e:  # a weight of another shape than the pool and the two widths give
        raise AudioEncoderError(f"{d}/projector.safetensors: {str(e).splitlines()[-1].strip()} (pool "
                                f"{pcfg['pool']})") from None
    if missing or unexpected:
        raise AudioEncoderError(f"{d}/projector.safetensors: missing {missing[:3]} unexpected {unexpected[:3]}")
    return encoder, proj.eval(), pcfg


def _projector_config(path: Path, hidden_size: int, vocab_size: int, frames: int) -> dict:
    """``projector.json`` checked against the LM (its hidden size, its vocabulary: the placeholder token the edge
    expands into the clip's rows) and the encoder (``frames`` rows a window, which ``pool`` must divide)."""
    try:
        pcfg = json.loads(path.read_text())
    except ValueError as e:  # not JSON, not UTF-8
        raise AudioEncoderError(f"{path}: not JSON ({e})") from None
    if not isinstance(pcfg, dict):
        raise AudioEncoderError(f"{path}: expected an object with pool, hidden_size and audio_token_id")
    for key in ("pool", "hidden_size", "audio_token_id"):
        if type(pcfg.get(key)) is not int:
            raise AudioEncoderError(f"{path}: {key} must be an integer, got {pcfg.get(key)!r}")
    if pcfg["hidden_size"] != hidden_size:
        raise AudioEncoderError(f"{path}: the projector maps to hidden size {pcfg['hidden_size']}, the LM has "
                                f"{hidden_size}")
    if pcfg["pool"] < 1 or frames % pcfg["pool"]:
        raise AudioEncoderError(f"{path}: pool {pcfg['pool']} does not divide the encoder's {frames} frames a window")
    if not 0 <= pcfg["audio_token_id"] < vocab_size:
        raise AudioEncoderError(f"{path}: audio_token_id {pcfg['audio_token_id']} is not a token of the LM's "
                                f"vocabulary (0 to {vocab_size - 1})")
    return pcfg


def save_audio_encoder(encoder_model: torch.nn.Module, projector: Projector, pcfg: dict, out: Path) -> Path:
    """Write a checkpoint directory :func:`load_audio_encoder` reads (``encoder_model``: a ``WhisperModel``)."""
    from safetensors.torch import save_file

    out = Path(out)
    encoder_model.save_pretrained(out)
    (out / "projector.json").write_text(json.dumps(pcfg) + "\n")
    save_file({k: v.contiguous() for k, v in projector.state_dict().items()}, str(out / "projector.safetensors"))
    return out


def audio_spec(encoder: torch.nn.Module, pcfg: dict) -> AudioSpec:
    cfg = encoder.config
    frames = int(cfg.max_source_positions) * 2  # the encoder's two stride-1/stride-2 convs halve the frames
    return AudioSpec(sample_rate=16000, n_fft=400, hop_length=160, n_mels=int(cfg.num_mel_bins),
                     window_frames=frames, pool=int(pcfg["pool"]), hidden_size=int(pcfg["hidden_size"]),
                     audio_token_id=int(pcfg["audio_token_id"]))


def export_audio(source: str | Path, hidden_size: int, vocab_size: int, bundle_dir: Path) -> AudioSpec:
    """Write ``edge/audio.onnx`` + ``edge/audio.json`` of the encoder at ``source`` into a bundle (fp32), for an LM of
    ``hidden_size`` and ``vocab_size`` (:func:`load_audio_encoder`)."""
    encoder, projector, pcfg = load_audio_encoder(source, hidden_size, vocab_size)
    encoder.config._attn_implementation = "sdpa"
    spec = audio_spec(encoder, pcfg)
    tower = AudioTower(encoder, projector).eval()
    example = torch.zeros(1, spec.n_mels, spec.window_frames)
    out = Path(bundle_dir) / AUDIO
    out.parent.mkdir(parents=True, exist_ok=True)
    from .export import quiet_exporter_logs

    quiet_exporter_logs()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(tower, (example,), dynamo=True, input_names=["input_features"],
                                    output_names=["audio_embeds"], optimize=True, verbose=False)
    program.save(str(out))
    (Path(bundle_dir) / AUDIO_CONFIG).write_text(json.dumps(asdict(spec), indent=2, sort_keys=True) + "\n")
    return spec
