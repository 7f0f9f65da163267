"""The fused top-p kernel (under the interpreter on CPU, compiled on CUDA) draws the torch formula's tokens:
excluded tokens, a partial last chunk, one chunk, many draws, a tiny nucleus (rows that miss), top_p 1, 16-bit
logits on CUDA; the decode graph's call (uniforms hashed in the kernel, greedy rows' argmax)."""

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
from cloud_server.engine import sampler as S
from cloud_server.engine import sampler_kernels as sk
from cloud_server.engine.sampling_params import SamplingParams
dev = "cuda" if torch.cuda.is_available() else "cpu"
g = torch.Generator().manual_seed(0)
rows = same = missed_same = 0
dtypes = (torch.float32, torch.bfloat16) if dev == "cuda" else (torch.float32,)
for s, v, r in ((4, 5000, 4), (3, 700, 16), (2, 40, 1), (4, 9000, 16), (3, 1536, 8)):
    for dtype in dtypes:
        x = (torch.randn(s, v, generator=g) * 3).to(dtype).float()  # values a 16-bit model can hold
        x[:, ::7] = float("-inf")
        top_p = torch.tensor([0.9, 0.5, 1.0, 0.02])[:s]
        inv_t = torch.tensor([1 / 0.7, 1.0, 2.0, 1 / 1.5])[:s]
        tries = torch.tensor([S.tries_for(float(p)) for p in top_p]).clamp(max=r)
        u = torch.rand(s, r, generator=g).clamp(1e-7, 1 - 1e-7)
        w = min(S.CHUNK, 1 << max(v - 1, 0).bit_length())
        want = S._top_p_formula(x, top_p, u, inv_t, tries, w)
        got = sk.top_p_draws(x.to(dev, dtype), top_p.to(dev), u.to(dev), inv_t.to(dev), tries.to(dev), w)
        rows += s
        same += int((got[0].cpu() == want[0]).sum())
        missed_same += int((got[1].cpu() == want[1]).sum())
# the decode graph's call: uniforms hashed from (key, position) in the kernel, greedy rows take their argmax
for s, v in ((5, 5000), (4, 1536)):
    x = (torch.randn(s, v, generator=g) * 3).float()
    keys = torch.randint(-(1 << 62), 1 << 62, (s,), generator=g)
    pos = torch.randint(0, 1 << 20, (s,), generator=g)
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.02, 0.9])[:s]
    inv_t = torch.tensor([1 / 0.7, 1.0, 2.0, 1 / 1.5, 1.0])[:s]
    tries = torch.tensor([S.tries_for(float(p)) for p in top_p])
    greedy = torch.tensor([False, True, False, False, True])[:s]
    w = min(S.CHUNK, 1 << max(v - 1, 0).bit_length())
    u = S.device_uniforms(keys, pos, S.TRIES)
    ids, miss = S._top_p_formula(x, top_p, u, inv_t, tries, w)
    am = x.argmax(dim=-1)
    want = (torch.where(greedy, am, ids), miss & ~greedy)
    got = sk.top_p_draws(x.to(dev), top_p.to(dev), None, inv_t.to(dev), tries.to(dev), w, draws=S.TRIES,
                         keys=keys.to(dev), positions=pos.to(dev), greedy=greedy.to(dev), argmax=am.to(dev))
    rows += s
    same += int((got[0].cpu() == want[0]).sum())
    missed_same += int((got[1].cpu() == want[1]).sum())
# the whole sampled path on this device: seeded rows draw the same tokens alone and batched
logits = (torch.randn(3, 700, generator=g) * 3).to(dev)
p = [SamplingParams(0.7, top_p=0.9, seed=i) for i in range(3)]
alone = [S.Sampler(0)(logits[i:i + 1], [p[i]], [5])[0].token_id for i in range(3)]
batched = [t.token_id for t in S.Sampler(0)(logits, p, [5] * 3)]
print(json.dumps({"rows": rows, "same": same, "missed_same": missed_same, "seeded": alone == batched}))
"""


def _run(env) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHECK], check=False, capture_output=True, text=True, env=env,
                         timeout=600, cwd=Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ok(r: dict) -> bool:  # (a draw within float rounding of a boundary may go the other way: at most one row)
    return r["same"] >= r["rows"] - 1 and r["missed_same"] >= r["rows"] - 1 and r["seeded"]


def test_top_p_kernel_draws_the_torch_formulas_tokens_under_the_interpreter():
    pytest.importorskip("triton")
    r = _run({**os.environ, "TRITON_INTERPRET": "1"})
    assert _ok(r), r


@pytest.mark.gpu
def test_top_p_kernel_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    r = _run(dict(os.environ))
    assert _ok(r), r
