"""The sampler's better-mass pass: the Triton kernel (under the interpreter on CPU, compiled on CUDA) equals the
torch formula, excluded tokens and padding included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_CHECK = """
import json, torch
from cloud_server.engine import sampler_kernels as sk
from cloud_server.engine.sampler import Sampler
from cloud_server.engine.sampling_params import SamplingParams
dev = "cuda" if torch.cuda.is_available() else "cpu"
g = torch.Generator().manual_seed(0)
errs = []
for s, v, r in ((3, 5000, 4), (2, 40, 1), (1, 9000, 16)):  # several blocks and a partial one, one block, many draws
    x = torch.randn(s, v, generator=g) * 2
    x[:, ::7] = float("-inf")
    e = torch.exp(x - x.amax(-1, keepdim=True))
    val = x[:, torch.randint(1, v, (r,), generator=g)]
    val[torch.isinf(val)] = 0.0
    want = torch.stack([torch.where(x > val[:, j:j + 1], e, 0.0).sum(-1) for j in range(r)], 1)
    got = sk.better_mass(x.to(dev), e.to(dev), val.to(dev)).cpu()
    errs.append(float(((got - want).abs() / want.clamp_min(1e-6)).max()))
# the whole sampled path on this device: seeded rows draw the same tokens alone and batched
logits = (torch.randn(3, 700, generator=g) * 3).to(dev)
p = [SamplingParams(0.7, top_p=0.9, seed=i) for i in range(3)]
alone = [Sampler(0)(logits[i:i + 1], [p[i]], [5])[0].token_id for i in range(3)]
batched = [t.token_id for t in Sampler(0)(logits, p, [5] * 3)]
print(json.dumps({"max_rel_err": max(errs), "same": alone == batched}))
"""


def _run(env) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHECK], check=False, capture_output=True, text=True, env=env,
                         timeout=300, cwd=Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_better_mass_kernel_equals_the_torch_formula_under_the_interpreter():
    pytest.importorskip("triton")
    r = _run({**os.environ, "TRITON_INTERPRET": "1"})
    assert r["max_rel_err"] < 1e-5 and r["same"], r


@pytest.mark.gpu
def test_better_mass_kernel_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    r = _run(dict(os.environ))
    assert r["max_rel_err"] < 1e-5 and r["same"], r
