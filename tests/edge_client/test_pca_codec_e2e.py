"""The PCA codecs through a real `autoglm-cloud serve` process and the edge client.

* ``split`` writes the codec artifact and records it (calibration.json, manifest); both ends offer the codecs;
* a request coded with ``pca-fine`` (prefill and decode steps) gives the unsplit model's greedy tokens on the
  tiny model, with fewer uplink bytes than fp16;
* an edge whose bundle lacks the artifact does not offer the codecs: insisting on one gives a clear
  ``codec_not_negotiated`` error instead of a garbled answer; a cloud whose bundle lacks it does not start.
"""

from __future__ import annotations

import json
import shutil

import pytest
from model_support import hf_greedy

from edge_client.client import EdgeClient
from edge_client.config import RetryPolicy
from edge_client.demo import LocalCloud
from edge_client.errors import EdgeClientError
from shared.manifest import Manifest

PROMPT = list(range(5, 45))
N_NEW = 12
RETRY = RetryPolicy(connect_timeout_s=5.0, reply_timeout_s=60.0, max_retries=5, backoff_initial_s=0.1,
                    backoff_max_s=0.5)


def test_split_records_the_codec_artifact(tiny_bundle):
    calib = json.loads((tiny_bundle / "calibration.json").read_text())
    ref = calib["pca_codec"]
    m = Manifest.load(tiny_bundle)
    assert m.artifacts[ref["file"]].sha256 == ref["sha256"] and m.artifacts[ref["file"]].role == "shared"
    assert set(ref["levels"]) == {"pca-fine", "pca-compact", "pca-ans-compact", "pca-tcq-compact"}


@pytest.fixture(scope="module")
def cloud(tiny_cloud):
    return tiny_cloud  # one server of the tiny bundle for the end-to-end modules (conftest)


def test_pca_fine_end_to_end(tiny_bundle, tiny_reference, cloud):
    want = hf_greedy(tiny_reference, PROMPT, N_NEW)
    with EdgeClient(tiny_bundle, cloud.ws_url, codec="fp16", retry=RETRY) as c:
        fp16 = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW)
    with EdgeClient(tiny_bundle, cloud.ws_url, codec="pca-fine", retry=RETRY) as c:
        gen = c.complete(prompt_ids=PROMPT, max_tokens=N_NEW)
    assert fp16.token_ids == want
    assert gen.stats.codec == "pca-fine" and gen.token_ids == want
    assert gen.stats.bytes_up < 0.75 * fp16.stats.bytes_up  # random weights: far from the real-model ~0.35


def test_an_edge_without_the_artifact_gets_a_clear_error(tiny_bundle, cloud, tmp_path):
    lacking = tmp_path / "b"
    shutil.copytree(tiny_bundle, lacking)
    (lacking / "codec_pca.npz").unlink()  # same bundle id, the artifact gone on the edge's side
    with EdgeClient(lacking, cloud.ws_url, codec="pca-compact", retry=RETRY) as c, \
            pytest.raises(EdgeClientError, match="pca-compact") as ei:
        c.complete(prompt_ids=PROMPT, max_tokens=2)
    assert ei.value.code == "codec_not_negotiated"
    with EdgeClient(lacking, cloud.ws_url, retry=RETRY) as c:  # the policy's choice still works
        assert len(c.complete(prompt_ids=PROMPT, max_tokens=2).token_ids) == 2


def test_a_cloud_without_the_artifact_does_not_start(tiny_bundle, tmp_path):
    lacking = tmp_path / "b"
    shutil.copytree(tiny_bundle, lacking)
    (lacking / "codec_pca.npz").unlink()
    log = tmp_path / "cloud.log"
    with pytest.raises(RuntimeError, match="exited"):
        with LocalCloud(lacking, log_path=log):
            pass
    assert "codec_pca.npz" in log.read_text()
