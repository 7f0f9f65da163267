"""The layer-skipping drafter: a subset of the cloud's layers on the phone, continuing from the boundary state.

Self-speculative drafting by layer skipping (Draft & Verify, Zhang et al. 2023; LayerSkip; SWIFT). The phone
runs layers [0, N) exactly anyway; the drafter continues from the boundary state ``h_N`` through M of the
cloud's layers [N, L) - the model's own weights, the skipped ones simply absent - then the final norm and the
lm_head, with its own KV cache for its M layers::

    h_N --layer a--> --layer b--> ... --layer m--> norm --> lm_head --> argmax = the draft

Which M layers: :func:`search` picks them greedily (forward selection: add the layer that raises the
calibration agreement most, M times) on calibration data only, scored teacher-forced in torch by
:class:`LayerProbe` (the top-1 agreement of the drafter's next token with the full model's greedy one; ties
go to the higher mean log-probability of the model's token). Calibration data (:func:`calibration`): the tail
of the built-in sample text (its first ``HELD_OUT`` tokens stay out, to measure agreement on) and the model's
own greedy answers to the calibration prompts of ``partition_tools/data/draft_prompts.txt`` (written for this;
``bench/draft_layers_bench.py`` checks they share nothing with the rig's workloads or the answer benches).

:func:`export_drafter` writes ``edge/draft_layers.onnx`` with the u-shape tail's interface
(``graph_builder.build_fused_stack``: GroupQueryAttention, in-place KV) and the tail's weight recipe (int8
MatMulNBits by default); ``--vocab K`` keeps the lm_head columns of the K most frequent calibration next tokens
(FR-Spec style, for GLM's 151 k vocabulary), their ids in the graph's metadata. :func:`add_draft_layers` does
it all for a bundle and records it (artifact + ``quant_report["draft_layers"]``: the layers, how they were
chosen, the calibration, the held-out agreement of the exported graph run as the phone runs it).
``edge_client.draft_layers`` runs it on the phone.
"""

from __future__ import annotations

import bisect
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from edge_client.draft_layers import DRAFT_LAYERS, VOCAB_KEY, LayerDrafter
from shared.manifest import BundleError

from .adapters import ModelAdapter, call_layer
from .draft_head import HELD_OUT, WINDOW, bundle_of
from .export_tail import tail_recipe
from .graph_builder import build_fused_stack
from .models import LoadedModel
from .progress import Steps
from .split import add_files, writing_unless

PROMPTS = Path(__file__).parent / "data" / "draft_prompts.txt"
BATCH_TOKENS = 4096  # token slots per torch forward (padding included)
ANSWER_BATCH = 16  # calibration prompts answered per generate call
SEARCH_TOPK = 8  # the search scores the union of the model's top-8 tokens per position (exact numbers: all)


@dataclass(slots=True)
class DraftLayersConfig:
    layers: tuple[int, ...] | None = None  # the cloud layers to draft with; None: greedy search under ``budget``
    budget: int = 6  # M: layers the search picks
    text: Path | None = None  # calibration prose (UTF-8); None: the built-in sample text (its tail)
    prose_tokens: int = 1536  # calibration prose tokens at most (after the held-out ones)
    prompts: Path | None = None  # calibration chat prompts, one a line; None: partition_tools/data/draft_prompts.txt
    answer_tokens: int = 64  # greedy answer tokens per calibration prompt
    vocab: int | None = None  # K: the drafter's vocabulary, the most frequent calibration next tokens; None: all
    quant: str = "int8"  # int8 | int4 | fp32 weights (the tail's recipe)
    chosen_by: str | None = None  # given ``layers``: how they were chosen, for the manifest (default "given")

    def __post_init__(self):
        problems = {f"quant {self.quant!r}: expected int8, int4 or fp32": self.quant not in ("int8", "int4", "fp32"),
                    f"budget {self.budget}: must be >= 1": self.layers is None and self.budget < 1,
                    "an empty layer list": self.layers is not None and not self.layers,
                    f"vocabulary {self.vocab}: must be >= 1": self.vocab is not None and self.vocab < 1,
                    "prose_tokens and answer_tokens must be >= 0": min(self.prose_tokens, self.answer_tokens) < 0}
        for what, bad in problems.items():
            if bad:
                raise BundleError(f"draft layers {what}")

    def checked_layers(self, split: int, num_layers: int) -> list[int] | None:
        """The given layers, sorted, or None for a search; BundleError when they, or the search's budget, do not
        fit a bundle split at ``split`` of ``num_layers`` layers (the manifest's: the CLI checks them before the
        model loads, rather than after it and the calibration)."""
        if self.layers is None:
            if self.budget > num_layers - split:
                raise BundleError(f"draft layers budget {self.budget}: the cloud has {num_layers - split} layers")
            return None
        return _checked_layers(self.layers, split, num_layers)


@dataclass(slots=True)
class Sequences:
    """Token sequences and, per sequence, the positions whose next token is scored."""

    ids: list[torch.Tensor] = field(default_factory=list)  # each int64 [T_i]
    scored: list[torch.Tensor] = field(default_factory=list)  # each bool [T_i]
    source: list[str] = field(default_factory=list)  # what went in, for the report

    def add(self, ids: torch.Tensor, scored: torch.Tensor) -> None:
        if ids.numel() >= 2 and bool(scored.any()):
            self.ids.append(ids)
            self.scored.append(scored)

    def add_prose(self, ids: torch.Tensor, window: int = WINDOW) -> None:
        """Windows of ``window`` tokens, every position but the last scored."""
        for s in range(0, ids.numel(), window):
            w = ids[s:s + window]
            scored = torch.ones(w.numel(), dtype=torch.bool)
            scored[-1] = False
            self.add(w, scored)

    @property
    def scored_tokens(self) -> int:
        return int(sum(int(s.sum()) for s in self.scored))


def read_prompts(path: Path | None = None) -> list[str]:
    """The calibration prompts (one a line, blank lines skipped)."""
    path = path or PROMPTS
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise BundleError(f"{path}: no calibration prompts")
    return prompts


@torch.no_grad()
def chat_answers(lm: LoadedModel, prompts: list[str], new: int) -> Sequences:
    """Each prompt (the tokenizer's chat template) and the model's greedy answer of up to ``new`` tokens; the
    positions that predict an answer token are scored."""
    seqs = Sequences()
    tok = lm.tokenizer
    eos = lm.model.generation_config.eos_token_id
    stops = {tok.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
    rendered = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                            add_generation_prompt=True)).input_ids for q in prompts]
    for b in range(0, len(rendered), ANSWER_BATCH):  # left-padded batches, one forward per new token
        group = rendered[b:b + ANSWER_BATCH]
        width = max(len(r) for r in group)
        ids = torch.full((len(group), width), tok.eos_token_id, dtype=torch.long)  # [B, P]
        mask = torch.zeros_like(ids)
        for i, r in enumerate(group):
            ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
        out = lm.model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, num_beams=1,
                                pad_token_id=tok.eos_token_id)  # [B, P + A]
        for i, r in enumerate(group):
            answer = out[i, width:].tolist()
            answer = answer[:next((j + 1 for j, t in enumerate(answer) if t in stops), len(answer))]
            seq = torch.tensor(r + answer)  # [P_i + A_i]
            scored = torch.zeros(seq.numel(), dtype=torch.bool)
            scored[len(r) - 1:seq.numel() - 1] = True
            seqs.add(seq, scored)
    seqs.source.append(f"{len(prompts)} chat prompts' greedy answers ({new} tokens at most)")
    return seqs


def prose_window(adapter: ModelAdapter) -> int:
    """Tokens per prose window: ``WINDOW``, or fewer for a model of a shorter context - the exported front and
    drafter hold its positions only (a 256-token model's held-out windows of 512 were a FrontError traceback)."""
    from .graph_builder import model_positions

    return min(WINDOW, model_positions(adapter))


def calibration(lm: LoadedModel, adapter: ModelAdapter, cfg: DraftLayersConfig) -> Sequences:
    """The search's data: calibration prose (the sample text after its held-out head) and the model's answers
    to the calibration prompts; random ids for presets without a tokenizer."""
    if lm.tokenizer is None:
        seqs = Sequences()
        gen = torch.Generator().manual_seed(2)
        seqs.add_prose(torch.randint(4, adapter.vocab_size, (max(cfg.prose_tokens, 2),), generator=gen),
                       prose_window(adapter))
        seqs.source.append("random ids (no tokenizer)")
        return seqs
    from .split import sample_text

    text = cfg.text.read_text(encoding="utf-8") if cfg.text is not None else sample_text()
    ids = lm.tokenizer(text, return_tensors="pt").input_ids[0]
    seqs = chat_answers(lm, read_prompts(cfg.prompts), cfg.answer_tokens) if cfg.answer_tokens else Sequences()
    prose = ids[HELD_OUT:HELD_OUT + cfg.prose_tokens]
    seqs.add_prose(prose, prose_window(adapter))
    seqs.source.append(f"{prose.numel()} tokens of {cfg.text or 'the built-in sample text'} after its first "
                       f"{HELD_OUT}")
    return seqs


def held_out_prose(lm: LoadedModel, adapter: ModelAdapter) -> Sequences:
    """The sample text's first ``HELD_OUT`` tokens (random ids without a tokenizer): never calibrated on."""
    seqs = Sequences()
    if lm.tokenizer is None:
        gen = torch.Generator().manual_seed(3)
        seqs.add_prose(torch.randint(4, adapter.vocab_size, (HELD_OUT,), generator=gen), prose_window(adapter))
    else:
        from .split import sample_text

        seqs.add_prose(lm.tokenizer(sample_text(), return_tensors="pt").input_ids[0][:HELD_OUT], prose_window(adapter))
    seqs.source.append(f"the first {HELD_OUT} tokens of the built-in sample text")
    return seqs


@dataclass(slots=True)
class _Batch:
    h: torch.Tensor  # [B, T, H]: the boundary states h_N
    pos: torch.Tensor  # [1, T]
    cos_sin: tuple
    scored: torch.Tensor  # bool [B, T]


class LayerProbe:
    """Teacher-forced agreement of layer subsets (module docstring): caches, for ``seqs``, the boundary states
    h_N and the full model's greedy next token at every scored position."""

    @torch.no_grad()
    def __init__(self, adapter: ModelAdapter, seqs: Sequences, split: int, batch_tokens: int = BATCH_TOKENS):
        if not 0 < split < adapter.num_layers:
            raise ValueError(f"split {split}: not inside the model's {adapter.num_layers} layers")
        self.adapter, self.split = adapter, split
        self.batches: list[_Batch] = []
        self.order: list[int] = []  # the sequences in the order of the batches (and of ``targets``)
        targets, top = [], []
        order = sorted(range(len(seqs.ids)), key=lambda i: seqs.ids[i].numel())
        while order:  # right-padded batches of similar lengths (causal attention: padding only follows)
            t_max = seqs.ids[order[-1]].numel()
            group = [order.pop() for _ in range(min(len(order), max(1, batch_tokens // t_max)))]
            self.order += group
            ids = torch.zeros(len(group), t_max, dtype=torch.long)  # [B, T]
            scored = torch.zeros(len(group), t_max, dtype=torch.bool)
            for b, i in enumerate(group):
                n = seqs.ids[i].numel()
                ids[b, :n], scored[b, :n] = seqs.ids[i], seqs.scored[i]
            hidden = adapter.embed_tokens(ids)
            pos = torch.arange(t_max)[None]  # [1, T]
            cos_sin = adapter.position_embeddings(hidden, pos)
            for blk in adapter.layers[:split]:
                hidden = call_layer(blk, hidden, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
            batch = _Batch(hidden, pos, cos_sin, scored)
            self.batches.append(batch)
            logits = self._logits(self._through(batch, hidden, range(split, adapter.num_layers)), scored)  # [n, V]
            targets.append(logits.argmax(-1))
            top.append(logits.topk(SEARCH_TOPK, dim=-1).indices.reshape(-1))
        self.targets = torch.cat(targets)  # [n]
        self.search_vocab = torch.unique(torch.cat(top + [self.targets]))  # [K']

    @property
    def candidates(self) -> list[int]:
        return list(range(self.split, self.adapter.num_layers))

    def boundary(self) -> list[torch.Tensor]:
        return [b.h for b in self.batches]

    def _through(self, batch: _Batch, x: torch.Tensor, layers) -> torch.Tensor:
        """``x`` [B, T, H] of ``batch`` through the decoder layers ``layers`` in order."""
        for i in layers:
            x = call_layer(self.adapter.layers[i], x, attention_mask=None, position_ids=batch.pos,
                           position_embeddings=batch.cos_sin)
        return x

    @torch.no_grad()
    def _run(self, layers, states: list[torch.Tensor]) -> list[torch.Tensor]:
        """``states`` (one [B, T, H] per batch) through the decoder layers ``layers`` in order."""
        return [self._through(b, x, layers) for b, x in zip(self.batches, states)]

    @torch.no_grad()
    def _logits(self, final: torch.Tensor, scored: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        x = self.adapter.norm(final[scored])  # [n, H]
        w = self.adapter.lm_head.weight if vocab is None else self.adapter.lm_head.weight[vocab]  # [V', H]
        logits = x @ w.T  # [n, V']
        bias = self.adapter.lm_head.bias
        return logits if bias is None else logits + (bias if vocab is None else bias[vocab])

    @torch.no_grad()
    def score(self, finals: list[torch.Tensor], exact: bool = True) -> tuple[float, float]:
        """(top-1 agreement, mean log-probability of the model's token) of the final residual states
        ``finals``; ``exact=False`` scores over :attr:`search_vocab` only (the search's fast proxy)."""
        vocab = None if exact else self.search_vocab
        logits = torch.cat([self._logits(f, b.scored, vocab) for f, b in zip(finals, self.batches)])  # [n, V']
        pred = logits.argmax(-1)
        target = self.targets if exact else torch.searchsorted(self.search_vocab, self.targets)
        logp = torch.log_softmax(logits, -1).gather(1, target[:, None])[:, 0]
        return float((pred == target).float().mean()), float(logp.mean())

    def agreement(self, layers) -> float:
        """Exact top-1 agreement of the drafter through ``layers`` (sorted cloud layers) with the model."""
        return self.score(self._run(sorted(layers), self.boundary()))[0]


def search(probe: LayerProbe, budget: int, held_out: LayerProbe | None = None) -> list[dict]:
    """Greedy forward selection of ``budget`` layers on ``probe``'s (calibration) data; one entry per M = 1 ..
    budget: the layers, their calibration agreement and (``held_out``) their held-out agreement, both exact.
    Each candidate reuses the states after the chosen layers below it."""
    if not 1 <= budget <= len(probe.candidates):
        raise BundleError(f"draft layers budget {budget}: the cloud has {len(probe.candidates)} layers")
    chosen: list[int] = []
    prefix = [probe.boundary()]  # prefix[i]: the states after chosen[:i]
    steps = []
    for _ in range(budget):
        best = None
        for j in probe.candidates:
            if j in chosen:
                continue
            i = bisect.bisect(chosen, j)
            score = probe.score(probe._run([j, *chosen[i:]], prefix[i]), exact=False)
            if best is None or score > best[0]:
                best = (score, j, i)
        _, j, i = best
        chosen.insert(i, j)
        prefix = prefix[:i + 1]
        for layer in chosen[i:]:
            prefix.append(probe._run([layer], prefix[-1]))
        step = {"layers": list(chosen), "calibration_agreement": round(probe.score(prefix[-1])[0], 4)}
        if held_out is not None:
            step["held_out_agreement"] = round(held_out.agreement(chosen), 4)
        steps.append(step)
    return steps


def frequent_vocab(probe: LayerProbe, k: int, vocab_size: int) -> np.ndarray:
    """The ``k`` most frequent next tokens of the model on the probe's data (FR-Spec), sorted: int64 [K]."""
    counts = np.bincount(probe.targets.numpy(), minlength=vocab_size)
    return np.sort(np.argsort(-counts, kind="stable")[:k]).astype(np.int64)


def _restrict_vocab(path: Path, vocab: np.ndarray) -> None:
    """Keep the lm_head columns of ``vocab`` in the graph at ``path``; its ids go in the metadata."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    for init in model.graph.initializer:
        if init.name in ("lm_head.weight", "lm_head.bias"):
            arr = numpy_helper.to_array(init)  # [H, V] or [V]
            init.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(arr[..., vocab]), init.name))
    logits = next(o for o in model.graph.output if o.name == "logits")
    logits.type.tensor_type.shape.dim[2].dim_value = int(vocab.size)
    onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                        VOCAB_KEY: json.dumps(vocab.tolist())})
    onnx.save(model, str(path))


def export_drafter(adapter: ModelAdapter, layers: list[int], out_path: Path, quant: str,
                   vocab: np.ndarray | None = None) -> dict:
    """Write the drafter graph of the cloud layers ``layers`` to ``out_path`` (module docstring); returns its
    quantization report."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = build_fused_stack(adapter, layers, Path(tmp) / "draft.onnx")
        if vocab is not None:
            _restrict_vocab(fp32, vocab)
        if quant == "fp32":
            shutil.move(str(fp32), out_path)
            return {"mode": "fp32"}
        from .quantize import quantize_front

        return quantize_front(fp32, out_path, quant, **tail_recipe(adapter, quant))


def _checked_layers(layers, split: int, num_layers: int) -> list[int]:
    out = sorted(set(int(i) for i in layers))
    if len(out) != len(layers) or out[0] < split or out[-1] >= num_layers:
        raise BundleError(f"draft layers {list(layers)}: need distinct cloud layers of [{split}, {num_layers})")
    return out


def exported_agreement(bundle: Path, drafter: LayerDrafter, probe: LayerProbe, seqs: Sequences) -> float:
    """Top-1 agreement of an exported ``drafter`` fed by the bundle's front, as the phone runs them, with the
    model's greedy next tokens on ``seqs`` (``probe``'s data)."""
    from edge_client.front import FrontRuntime

    front = FrontRuntime(bundle, verify=False)
    got = []
    for i in probe.order:  # the order of probe.targets
        front.reset()
        drafter.reset()
        rows = front.prefill(seqs.ids[i].numpy())  # [T, H]
        got.append(drafter.next_tokens(rows)[seqs.scored[i].numpy()])
    return float((np.concatenate(got) == probe.targets.numpy()).mean())


STEPS = 4  # the progress lines add_draft_layers prints (partition_tools.progress)


def add_draft_layers(lm: LoadedModel, bundle: Path, cfg: DraftLayersConfig | None = None,
                     progress: Steps | None = None,
                     staged: Path | None = None) -> dict:
    """Choose (or take), export and register the layer drafter of ``bundle`` (split from ``lm``); returns the
    report recorded in its manifest. ``progress``: the progress it goes on (its ``STEPS`` lines)."""
    cfg = cfg or DraftLayersConfig()
    progress = progress or Steps(STEPS, "draft-head")
    bundle = Path(bundle)
    with writing_unless(bundle, staged) as staged:  # the new file written there, then put in
        manifest, adapter = bundle_of(lm, bundle)
        split = manifest.split_layer
        layers = cfg.checked_layers(split, adapter.num_layers)
        progress.next("calibration: held-out prose" + (", chat answers" if layers is None or cfg.vocab is not None
                                                       else "") + " through the model")
        held = held_out_prose(lm, adapter)
        held_probe = LayerProbe(adapter, held, split)
        # the calibration data: for the search, or the vocabulary of given layers (none needed otherwise)
        seqs = calibration(lm, adapter, cfg) if layers is None or cfg.vocab is not None else None
        probe = None if seqs is None else LayerProbe(adapter, seqs, split)
        progress.next(f"greedy search for {cfg.budget} of the cloud's layers" if layers is None else
                      f"layers {layers} as given")
        if layers is None:
            steps = search(probe, cfg.budget, held_probe)
            layers, how = steps[-1]["layers"], f"greedy forward selection, budget {cfg.budget}"
        else:
            how, steps = cfg.chosen_by or "given", []
        vocab = None if cfg.vocab is None or cfg.vocab >= adapter.vocab_size else \
            frequent_vocab(probe, cfg.vocab, adapter.vocab_size)
        progress.next(f"export layers {layers} + norm + lm_head ({cfg.quant})")
        quant = export_drafter(adapter, layers, staged / DRAFT_LAYERS, cfg.quant, vocab)
        report = {"layers": layers, "chosen_by": how, "quant": cfg.quant,
                  "vocab": adapter.vocab_size if vocab is None else int(vocab.size),
                  "calibration": "; ".join(seqs.source) if seqs is not None else None,
                  "calibration_tokens": seqs.scored_tokens if seqs is not None else 0,
                  "held_out": "; ".join(held.source), "held_out_tokens": held.scored_tokens,
                  "calibration_top1_agreement_torch_fp32": round(probe.agreement(layers), 4) if probe else None,
                  "held_out_top1_agreement_torch_fp32": round(held_probe.agreement(layers), 4),
                  "search": steps, "bytes": (staged / DRAFT_LAYERS).stat().st_size, "weights": quant}
        progress.next("held-out agreement of the exported drafter, manifest")
        drafter = LayerDrafter(staged / DRAFT_LAYERS, manifest, len(layers))
        report["held_out_top1_agreement"] = round(exported_agreement(bundle, drafter, held_probe, held), 4)
        manifest.quant_report["draft_layers"] = report
        manifest.add_artifact(staged, DRAFT_LAYERS, "edge")
        add_files(bundle, staged, manifest)  # all or nothing, as no client holds the bundle
    return report
