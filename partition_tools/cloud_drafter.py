"""The cloud drafter: a table that lets the server draft the phone's next tokens with its own layers.

In split mode the cloud samples token t but cannot compute t + 1 before the phone has run t through the front
layers and sent its boundary state ``h_N(t)``: one round trip per token. The phone's own drafters know little
of the model (prompt lookup; the layer drafter, ~30 % agreement on SmolLM2 chat). The cloud holds everything
else the next prediction needs - the deep layers and the true KV of every earlier position - and lacks only
that one row. So it approximates the row from the token alone::

    h_N(t) ~ table[t] = [e(t), 1] @ W        e = the input embedding, W [H + 1, H] by ridge regression

fitted on the model's own boundary states (calibration: the built-in sample text after its held-out head and
the model's greedy answers to ``partition_tools/data/draft_prompts.txt``, as the layer drafter's), and
precomputed for the whole vocabulary into ``cloud/draft_inputs.npy`` (float16 ``[V, H]``: 57 MB for SmolLM2,
1.2 GB for GLM-4's 151 k vocabulary at H = 4,096). The server feeds ``table[t]`` at t's position through its
layers, with the real context's KV, takes the argmax as draft d1, feeds ``table[d1]`` for d2, and so on
(``cloud_server.engine.llm_engine``, "cloud drafts"); the phone runs [t, d1, ..] through its front as one chunk
and the cloud verifies them as any SpecStep. Nothing new leaves the phone: the drafts are the cloud's.

:func:`agreement` measures what the report records: how often the cloud's layers, fed ``table[t]`` at the
newest position and the true states before it, predict the model's own next token (teacher-forced, one draft
deep). The regularisation is chosen on a fold of the calibration data, never on the held-out text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.manifest import CLOUD_DRAFT_INPUTS

from .adapters import ModelAdapter, call_layer
from .draft_head import bundle_of
from .draft_layers import DraftLayersConfig, Sequences, calibration, held_out_prose
from .models import LoadedModel
from .progress import Steps
from .split import add_files, writing_unless

LAMBDAS = (0.1, 1.0, 10.0, 30.0, 100.0)  # ridge strengths tried, relative to the mean diagonal of X^T X / 1000
VOCAB_CHUNK = 8192  # vocabulary rows per table matmul


@dataclass(slots=True)
class CloudDrafterConfig:
    text: Path | None = None  # calibration prose; None: the built-in sample text's tail
    prompts: Path | None = None  # calibration chat prompts; None: partition_tools/data/draft_prompts.txt
    answer_tokens: int = 64  # greedy answer tokens per calibration prompt


@torch.no_grad()
def _front(adapter: ModelAdapter, ids: torch.Tensor, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For ids [T]: input embeddings e [T, H] and boundary states h_N [T, H] (float64)."""
    x = adapter.embed_tokens(ids[None])  # [1, T, H]
    e = x[0].double()
    pos = torch.arange(ids.numel())[None]
    cos_sin = adapter.position_embeddings(x, pos)
    for blk in adapter.layers[:split]:
        x = call_layer(blk, x, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
    return e, x[0].double()


def fit(adapter: ModelAdapter, seqs: Sequences, split: int) -> tuple[torch.Tensor, dict]:
    """The ridge map ``W`` [H + 1, H] from [e, 1] to h_N over every position of ``seqs``; the strength is the
    one with the least squared error on the last fifth of the sequences (fitted on the rest)."""
    rows = [_front(adapter, ids, split) for ids in seqs.ids]
    cut = max(1, len(rows) * 4 // 5)

    def gram(part):
        x = torch.cat([torch.cat([e, torch.ones(len(e), 1, dtype=e.dtype)], 1) for e, _ in part])  # [n, H + 1]
        y = torch.cat([h for _, h in part])  # [n, H]
        return x.T @ x, x.T @ y, x, y

    def solve(xtx, xty, lam):
        scale = float(torch.diagonal(xtx).mean()) / 1000
        return torch.linalg.solve(xtx + lam * scale * torch.eye(len(xtx), dtype=xtx.dtype), xty)

    xtx, xty, _, _ = gram(rows[:cut])
    errors = {}
    if cut < len(rows):
        _, _, xv, yv = gram(rows[cut:])
        for lam in LAMBDAS:
            errors[lam] = float(((xv @ solve(xtx, xty, lam) - yv) ** 2).mean())
    lam = min(errors, key=errors.get) if errors else LAMBDAS[1]
    xtx_all, xty_all, _, _ = gram(rows)
    w = solve(xtx_all, xty_all, lam)
    return w, {"ridge_lambda": lam, "validation_mse": {str(k): round(v, 5) for k, v in errors.items()},
               "positions": int(sum(len(e) for e, _ in rows))}


@torch.no_grad()
def table_of(adapter: ModelAdapter, w: torch.Tensor) -> np.ndarray:
    """Every token's draft row: ``[e(v), 1] @ W`` for the whole vocabulary, float16 ``[V, H]``."""
    emb = adapter.embed_tokens.weight  # [V, H]
    out = np.empty((emb.shape[0], w.shape[1]), dtype=np.float16)
    wf = w.float()
    for s in range(0, emb.shape[0], VOCAB_CHUNK):
        e = emb[s:s + VOCAB_CHUNK].float()
        out[s:s + len(e)] = (e @ wf[:-1] + wf[-1]).clamp(-65000, 65000).numpy()
    return out


@torch.no_grad()
def _mixed_argmax(adapter: ModelAdapter, h: torch.Tensor, approx: torch.Tensor, split: int) -> torch.Tensor:
    """The cloud layers' argmax at every position t when position t holds ``approx[t]`` and the positions before
    it their true states ``h``: one forward over [h; approx] ([1, 2T, H]) with a mask where approximate row t
    sees true rows < t and itself. Returns [T]."""
    t = h.shape[0]
    x = torch.cat([h, approx]).to(adapter.embed_tokens.weight.dtype)[None]  # [1, 2T, H]
    pos = torch.cat([torch.arange(t), torch.arange(t)])[None]  # [1, 2T]
    allowed = torch.zeros(2 * t, 2 * t, dtype=torch.bool)
    allowed[:t, :t] = torch.tril(torch.ones(t, t, dtype=torch.bool))
    allowed[t:, :t] = torch.tril(torch.ones(t, t, dtype=torch.bool), -1)
    allowed[t:, t:] = torch.eye(t, dtype=torch.bool)
    mask = torch.zeros(2 * t, 2 * t, dtype=x.dtype).masked_fill(~allowed, torch.finfo(x.dtype).min)[None, None]
    cos_sin = adapter.position_embeddings(x, pos)
    for blk in adapter.layers[split:]:
        x = call_layer(blk, x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
    return adapter.lm_head(adapter.norm(x[0, t:])).argmax(-1)


@torch.no_grad()
def agreement(adapter: ModelAdapter, table: np.ndarray, seqs: Sequences, split: int) -> tuple[float, int]:
    """(Top-1 agreement of the one-deep cloud draft with the model's greedy next token, positions scored) over
    the scored positions of ``seqs``."""
    hit = total = 0
    tab = torch.from_numpy(table)
    for ids, scored in zip(seqs.ids, seqs.scored):
        _, h = _front(adapter, ids, split)
        x = h.to(adapter.embed_tokens.weight.dtype)[None]
        pos = torch.arange(ids.numel())[None]
        cos_sin = adapter.position_embeddings(x, pos)
        for blk in adapter.layers[split:]:
            x = call_layer(blk, x, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
        target = adapter.lm_head(adapter.norm(x[0])).argmax(-1)  # [T]: the model's next token
        draft = _mixed_argmax(adapter, h, tab[ids].double(), split)
        hit += int((draft == target)[scored].sum())
        total += int(scored.sum())
    return hit / max(total, 1), total


def _save_npy(path: Path, table: np.ndarray) -> None:
    """``np.save``'s file, written through Python's file object: numpy's own writer reports a full disk as a bare
    OSError ('65536 requested and 32704 written', no errno), which ended draft-head in a traceback."""
    from numpy.lib import format as npy

    table = np.ascontiguousarray(table)
    with open(path, "wb") as f:
        npy.write_array_header_1_0(f, npy.header_data_from_array_1_0(table))
        f.write(memoryview(table).cast("B"))


STEPS = 3  # the progress lines add_cloud_drafter prints (partition_tools.progress)


def add_cloud_drafter(lm: LoadedModel, bundle: Path, cfg: CloudDrafterConfig | None = None,
                      progress: Steps | None = None,
                      staged: Path | None = None) -> dict:
    """Fit, write and register ``cloud/draft_inputs.npy`` of ``bundle`` (split from ``lm``); returns the report
    recorded in its manifest (``quant_report["cloud_drafter"]``). ``progress``: the progress it goes on (its ``STEPS``
    lines)."""
    cfg = cfg or CloudDrafterConfig()
    progress = progress or Steps(STEPS, "draft-head")
    bundle = Path(bundle)
    with writing_unless(bundle, staged) as staged:  # the new file written there, then put in
        manifest, adapter = bundle_of(lm, bundle)
        split = manifest.split_layer
        progress.next("calibration: text and chat answers through the model")
        seqs = calibration(lm, adapter, DraftLayersConfig(text=cfg.text, prompts=cfg.prompts,
                                                          answer_tokens=cfg.answer_tokens))
        progress.next(f"fit the table, write {CLOUD_DRAFT_INPUTS}")
        w, fit_report = fit(adapter, seqs, split)
        table = table_of(adapter, w)
        path = staged / CLOUD_DRAFT_INPUTS
        path.parent.mkdir(parents=True, exist_ok=True)
        _save_npy(path, table)
        progress.next("held-out agreement of the table's drafts, manifest")
        held = held_out_prose(lm, adapter)
        held_agree, held_n = agreement(adapter, table, held, split)
        report = {"file": CLOUD_DRAFT_INPUTS, "map": "ridge [e(t), 1] -> h_N(t)", **fit_report,
                  "calibration": "; ".join(seqs.source), "held_out": "; ".join(held.source),
                  "held_out_tokens": held_n, "held_out_top1_agreement": round(held_agree, 4),
                  "bytes": path.stat().st_size}
        manifest.quant_report["cloud_drafter"] = report
        manifest.add_artifact(staged, CLOUD_DRAFT_INPUTS, "cloud-draft")  # outside the bundle id (shared.manifest)
        add_files(bundle, staged, manifest)  # all or nothing, as no client holds the bundle
    return report
