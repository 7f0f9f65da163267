"""What the cloud can learn from the boundary: inversion attacks on the hidden states, and the measured figures.

The cloud half receives the hidden states after layers [0, N) of every prompt token. It also holds the model,
so it can run the front over any text of its own and learn the map from boundary states back to tokens. The
attacks here are that attacker; each maps boundary states ``[T, H]`` to token ids ``[T]`` (top-1):

* :func:`embedding_match` - the nearest row of the input embedding table (cosine). The trivial attack: exact
  where the states are the embeddings (N = 0). On SmolLM2 it fails from N = 1, where layer 0 has added a large
  token-dependent vector; the linear inverter below undoes that.
* :func:`nearest_neighbour` - the token of the nearest training state (cosine after per-channel
  standardisation, so the few massive-activation channels do not decide every comparison).
* :func:`train_inverter` - a learned linear inverter: ridge regression from the (standardised) states into the
  embedding space, then the nearest embedding row, so it can name tokens the training corpus never had; with
  ``context=c`` it also sees the ``c`` neighbouring states on each side (attention has mixed each token into
  its successors' states).

:func:`boundary_states` collects the states the edge would upload (an fp32 front: the edge's int8 weights add
noise of their own). ``bench/inversion_bench.py`` runs the attacks on SmolLM2 and writes
``docs/results/privacy_inversion.json``; :func:`recovered_fraction` reads that file, so the split planner can show
the figure beside each candidate N. Threat model and figures: docs/security.md.

References: split-inference inversion, arXiv:2602.16760 (an inversion attack recovers ~59 % of input tokens at a
2-layer split, ~35 % at 8 layers); massive activations, Sun et al. 2024, arXiv:2402.17762.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from shared.manifest import same_source

from .adapters import ModelAdapter, call_layer

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "privacy_inversion.json"
NO_CODEC = "none"  # the figures' key for states attacked as the front computed them (fp32)


# -- collecting the boundary ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class BoundaryStates:
    """Boundary states of a set of windows (independent sequences, each starting at position 0), concatenated."""

    ids: torch.Tensor  # [T] int64 token ids
    position: torch.Tensor  # [T] int64 position of each token in its window
    states: dict[int, torch.Tensor]  # N -> [T, H] float32: the hidden states after layers [0, N)

    def __post_init__(self):
        t = self.ids.shape[0]
        if self.position.shape != (t,) or any(s.ndim != 2 or s.shape[0] != t for s in self.states.values()):
            raise ValueError("BoundaryStates: ids [T], position [T] and every state [T, H] must agree on T")


def windows(token_ids: Sequence[Sequence[int]], max_len: int) -> list[torch.Tensor]:
    """Cut each document's ids into windows of at most ``max_len`` tokens (empty documents are dropped)."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    out = []
    for ids in token_ids:
        for i in range(0, len(ids), max_len):
            out.append(torch.tensor(list(ids[i:i + max_len]), dtype=torch.long))  # [S]
    return out


@torch.no_grad()
def boundary_states(adapter: ModelAdapter, wins: Sequence[torch.Tensor], layers: Sequence[int],
                    batch_tokens: int = 4096) -> BoundaryStates:
    """Run the first ``max(layers)`` decoder layers over each window and keep the states after layers [0, N)
    for every N in ``layers`` (N = 0: the embeddings). Each window is its own sequence (positions from 0).

    Windows of similar length run together, right-padded: under the causal mask no real token sees a pad, so
    each window's states are those of the window alone."""
    layers = sorted(set(layers))
    if not wins or any(w.ndim != 1 or w.numel() == 0 for w in wins):
        raise ValueError("boundary_states needs one or more non-empty 1-D windows of token ids")
    if not layers or layers[0] < 0 or layers[-1] > adapter.num_layers:
        raise ValueError(f"layers {layers}: each must be in [0, {adapter.num_layers}]")
    order = sorted(range(len(wins)), key=lambda i: -wins[i].numel())
    per_window: dict[int, dict[int, torch.Tensor]] = {}
    i = 0
    while i < len(order):
        longest = wins[order[i]].numel()
        group = order[i:i + max(1, batch_tokens // longest)]
        i += len(group)
        ids = torch.zeros(len(group), longest, dtype=torch.long)  # [B, S] right-padded with id 0
        for row, w in enumerate(group):
            ids[row, :wins[w].numel()] = wins[w]
        hidden = adapter.embed_tokens(ids).float()  # [B, S, H]
        pos = torch.arange(longest)[None].expand(len(group), -1)  # [B, S]
        cos_sin = adapter.position_embeddings(hidden, pos)
        kept = {}
        for n in range(layers[-1] + 1):
            if n in layers:
                kept[n] = hidden.clone()
            if n < layers[-1]:
                hidden = call_layer(adapter.layers[n], hidden, attention_mask=None, position_ids=pos,
                                    position_embeddings=cos_sin)
        for row, w in enumerate(group):
            per_window[w] = {n: h[row, :wins[w].numel()] for n, h in kept.items()}  # [S, H]
    return BoundaryStates(
        ids=torch.cat(list(wins)),
        position=torch.cat([torch.arange(w.numel()) for w in wins]),
        states={n: torch.cat([per_window[w][n] for w in range(len(wins))]).float() for n in layers},
    )


def through_codec(states: torch.Tensor, position: torch.Tensor, codec) -> torch.Tensor:
    """``states`` [T, H] as the cloud sees them after ``codec`` (a ``shared.codecs.BoundaryCodec``): each window
    encoded as one message and decoded."""
    starts = torch.nonzero(position == 0).flatten().tolist() + [states.shape[0]]
    out = []
    for a, b in zip(starts[:-1], starts[1:]):
        x = states[a:b].numpy()  # [S, H]
        out.append(torch.from_numpy(codec.decode(codec.encode(x))))
    return torch.cat(out)


# -- attacks --------------------------------------------------------------------------------------------------

def _cosine_argmax(queries: torch.Tensor, keys: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Index of the key [K, H] most cosine-similar to each query [T, H]: [T]."""
    keys = torch.nn.functional.normalize(keys, dim=-1)
    out = []
    for q in queries.split(chunk):
        out.append((torch.nn.functional.normalize(q, dim=-1) @ keys.T).argmax(dim=-1))  # [chunk]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


@torch.no_grad()
def embedding_match(states: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
    """The trivial attack: for each state [T, H] the id of the nearest embedding row [V, H] (cosine): [T]."""
    return _cosine_argmax(states.float(), embedding.float())


@dataclass(frozen=True, slots=True)
class Standardizer:
    """Per-channel z-scores with the training states' statistics."""

    mean: torch.Tensor  # [H]
    std: torch.Tensor  # [H]

    @classmethod
    def fit(cls, states: torch.Tensor) -> Standardizer:
        return cls(states.mean(dim=0), states.std(dim=0).clamp_min(1e-6))

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        return (states - self.mean) / self.std


@torch.no_grad()
def nearest_neighbour(train_states: torch.Tensor, train_ids: torch.Tensor, test_states: torch.Tensor) -> torch.Tensor:
    """For each test state [T, H] the token of the nearest training state [K, H] (cosine of z-scores): [T]."""
    z = Standardizer.fit(train_states)
    return train_ids[_cosine_argmax(z(test_states), z(train_states))]


@dataclass(slots=True)
class InverterConfig:
    context: int = 0  # neighbouring states seen on each side (0: the token's own state only)
    ridge: float = 1e-3  # L2 penalty, as a fraction of the mean feature energy (z-scores: ~1 per token)

    def __post_init__(self):
        if self.context < 0:
            raise ValueError(f"InverterConfig.context must be >= 0, got {self.context}")
        if self.ridge <= 0:
            raise ValueError(f"InverterConfig.ridge must be > 0, got {self.ridge}")


def with_context(states: torch.Tensor, position: torch.Tensor, context: int) -> torch.Tensor:
    """Each state [T, H] followed by its neighbours at offsets -context..context within its window (zeros past
    the window's ends): [T, (2 * context + 1) * H]."""
    if context == 0:
        return states
    t = states.shape[0]
    parts = []
    for k in range(-context, context + 1):
        idx = torch.arange(t) + k  # [T]
        inside = (idx >= 0) & (idx < t)
        idx = idx.clamp(0, t - 1)
        same = inside & (position[idx] == position + k)  # the neighbour is in the same window
        parts.append(states[idx] * same[:, None])
    return torch.cat(parts, dim=-1)


@dataclass(frozen=True, slots=True)
class Inverter:
    """A linear map from boundary states (z-scores, with neighbours) into the input-embedding space; a state's
    token is the embedding row nearest (cosine) to its image. It names any token of the vocabulary, also ones
    the training corpus never had."""

    cfg: InverterConfig
    z: Standardizer
    weight: torch.Tensor  # [(2c+1) H + 1, E] (last row: bias)
    embedding: torch.Tensor  # [V, E] the model's input embedding table

    def project(self, states: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Images in the embedding space [T, E] of states [T, H] with their window positions [T]."""
        return _features(self.z, states, position, self.cfg.context) @ self.weight

    @torch.no_grad()
    def predict(self, states: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Token ids [T] for states [T, H] with their window positions [T]."""
        return _cosine_argmax(self.project(states, position), self.embedding)


def _features(z: Standardizer, states: torch.Tensor, position: torch.Tensor, context: int) -> torch.Tensor:
    x = with_context(z(states), position, context)  # [T, (2c+1) H]
    return torch.cat([x, torch.ones(x.shape[0], 1)], dim=-1)  # [T, (2c+1) H + 1]


@torch.no_grad()
def train_inverter(states: torch.Tensor, ids: torch.Tensor, position: torch.Tensor, embedding: torch.Tensor,
                   cfg: InverterConfig) -> Inverter:
    """Fit an :class:`Inverter` in closed form (ridge regression of the tokens' embedding rows on the states)
    from training states [T, H], their ids [T] and window positions [T]. Deterministic."""
    embedding = embedding.float()
    z = Standardizer.fit(states)
    x = _features(z, states, position, cfg.context)  # [T, D]
    gram = x.T @ x  # [D, D]; z-scores keep it well scaled, the ridge keeps it well conditioned
    penalty = cfg.ridge * gram.diagonal().mean() * torch.eye(gram.shape[0])
    weight = torch.linalg.solve(gram + penalty, x.T @ embedding[ids])  # [D, E]
    return Inverter(cfg, z, weight, embedding)


def recovered(predicted: torch.Tensor, truth: torch.Tensor) -> float:
    """Fraction of tokens whose top-1 guess is the input token."""
    if predicted.shape != truth.shape or truth.numel() == 0:
        raise ValueError(f"predicted {tuple(predicted.shape)} and truth {tuple(truth.shape)}: same non-empty shape")
    return float((predicted == truth).float().mean())


# -- the measured figures -------------------------------------------------------------------------------------

@lru_cache(maxsize=4)
def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def recovered_fraction(layer: int, codec: str = NO_CODEC, model: str | None = None,
                       path: Path = RESULTS) -> float | None:
    """The fraction of held-out input tokens the strongest attack recovered from the boundary after ``layer``
    decoder layers (``bench/inversion_bench.py``), for states sent through ``codec`` (``"none"``: as computed).

    The figures are one model's (SmolLM2-135M in the committed file): pass ``model`` (a
    ``LoadedModel.identity``) to get ``None`` for any other model. Between two measured layers the figure is
    interpolated linearly; outside the measured range, for an unmeasured codec, or without the results file:
    ``None``."""
    data = _load(Path(path))
    if data is None or (model is not None and not same_source(str(data.get("model")), model)):
        return None
    best = data.get("best", {}).get(codec)
    if not best:
        return None
    measured = {int(n): float(v) for n, v in best.items()}
    if layer in measured:
        return measured[layer]
    points = sorted(measured.items())
    for (n0, v0), (n1, v1) in zip(points, points[1:]):
        if n0 < layer < n1:
            return v0 + (v1 - v0) * (layer - n0) / (n1 - n0)
    return None  # outside the measured layers


__all__ = [
    "NO_CODEC",
    "RESULTS",
    "BoundaryStates",
    "Inverter",
    "InverterConfig",
    "Standardizer",
    "boundary_states",
    "embedding_match",
    "nearest_neighbour",
    "recovered",
    "recovered_fraction",
    "through_codec",
    "train_inverter",
    "windows",
    "with_context",
]
