"""A small reference cloud for edge tests: the scripted protocol server (``tests/protocol_fake_server.py``:
the shared state machine over a real WebSocket, the failure knobs) with a real model in place of the script:
the bundle's back half recomputed over the whole context each step (slow, obviously correct).

It is a test double for the *edge*: the real server (cloud_server) is exercised end to end elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from partition_tools.cloud_half import CloudModel
from shared import codecs as C
from tests.protocol_fake_server import ScriptedRequest, ScriptedServer


class FakeCloud(ScriptedServer):
    def __init__(self, bundle, block_size: int = 16):
        self.back = CloudModel.from_bundle(bundle)
        manifest = self.back.manifest
        codecs = C.available_codecs(json.loads((Path(bundle) / "calibration.json").read_text()))
        super().__init__(manifest.bundle_id, manifest.hidden_size, codecs, block_size=block_size,
                         eos_token_ids=tuple(manifest.eos_token_ids))

    def next_token(self, req: ScriptedRequest) -> int:
        h = torch.from_numpy(np.stack(req.hidden))[None]  # [1, S, H]
        pos = torch.arange(h.shape[1])[None]  # [1, S]
        with torch.no_grad():
            logits = self.back(h, pos)[0, -1]  # [V]
        return int(torch.argmax(logits))  # greedy only: this double checks the edge, not sampling
