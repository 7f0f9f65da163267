"""partition_tools.codec_calibration: calibration text disjoint from the evaluation, artifact recorded with its hash."""

from __future__ import annotations

import hashlib
import json

import torch

from partition_tools.codec_calibration import EVAL_TOKENS, WINDOW, codec_calibration_windows
from partition_tools.models import LoadedModel
from partition_tools.split import sample_text


class _Tok:
    """Character-level stand-in for a tokenizer: id = code point."""

    chat_template = "x"

    def __call__(self, text, return_tensors=None):
        return type("E", (), {"input_ids": torch.tensor([[ord(c) for c in text]])})()

    def decode(self, ids):
        return "".join(chr(int(i)) for i in ids)

    def apply_chat_template(self, chat, tokenize=True, return_dict=False):
        return [1, *(ord(c) for m in chat for c in m["content"]), 2]


def test_windows_skip_the_evaluation_tokens_and_include_a_chat():
    text_ids = [ord(c) for c in sample_text()]
    wins = codec_calibration_windows(LoadedModel(None, _Tok(), "stub", "stub"), 512)
    plain = torch.cat([w[0] for w in wins[:-1]]).tolist()
    assert plain == text_ids[EVAL_TOKENS:] and all(w.shape[1] <= WINDOW for w in wins[:-1])
    chat = wins[-1][0].tolist()
    assert chat[0] == 1 and chat[-1] == 2  # the template's special tokens are in the calibration
    assert not set(map(tuple, [text_ids[i:i + 64] for i in range(0, EVAL_TOKENS - 64, 64)])) & \
        {tuple(chat[i:i + 64]) for i in range(len(chat) - 64)}  # no evaluation text in the chat either


def test_split_records_the_artifact_hash(tiny_glm4_fp32_bundle):
    ref = json.loads((tiny_glm4_fp32_bundle / "calibration.json").read_text())["pca_codec"]
    data = (tiny_glm4_fp32_bundle / ref["file"]).read_bytes()
    assert hashlib.sha256(data).hexdigest() == ref["sha256"] and ref["tokens"] >= 4 * WINDOW
