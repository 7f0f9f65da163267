"""Tensor parallelism over 2 ranks: one sharding pass over a plain model, and how the ranks run it.

Sharding (gpt-fast's ``tp.py`` idea: no second model implementation). :func:`shard_model` shards a
:class:`~partition_tools.cloud_half.CloudModel`'s weights in place before any runner is built, so every
runner runs the same shards: the library's ``ModelRunner`` (any architecture, int8 too) and the GLM fast
path (``FastGlmRunner`` fuses the sharded layers' weights). Megatron-style, per decoder layer:

* column-parallel: ``q_proj``, ``k_proj``, ``v_proj`` (whole heads, with their biases), ``gate_proj`` /
  ``up_proj`` or the fused ``gate_up_proj`` (each half split on its own);
* row-parallel: ``o_proj`` and ``down_proj`` take their input-channel shard and all-reduce their output
  (:class:`RowParallel`; a bias is added once, on rank 0): two all-reduces of [T, H] per layer;
* vocab-parallel: the ``lm_head`` keeps its ``1 / world`` of the vocabulary (the last shard zero-padded) and
  the logits are all-gathered (:class:`VocabParallel`), so every rank computes logits and rank 0 samples.

Norms, embeddings and the residual stream are replicated. The attention modules size their heads from the
projection output (``view(..., -1, head_dim)``), so each rank runs ``heads / tp`` query heads over
``kv_heads / tp`` KV heads of its own KV pool (``model.num_kv_heads`` becomes the rank's share, which sizes
the pool). GLM-4.1V has 2 KV heads: TP = 2 shards them exactly, halving weights and cache per GPU.

Rank protocol. Rank 0 owns the network, the scheduler and the sampler. Every forward pass it broadcasts the
flat batch (``cloud_server.engine.model_runner.Batch``) as fixed-layout tensors (:class:`BroadcastingRunner`):
an int64 header, one int64 tensor with the positions, slots, lengths, block tables and logits rows, and the
float32 hidden states. No pickle crosses the process boundary. Workers are plain subprocesses
(``python -m cloud_server.tp --rank 1 ...``) that load and shard their own weights and build the same runners
from the same :class:`~cloud_server.config.EngineConfig` (sent as JSON on their command line), so every rank
takes the same path through a step and issues the same collectives (CUDA graphs included).

Process group. Rank 0 opens the group's TCP store on a port the OS assigns while binding it (never a port
probed free and bound later, which another process may take in between) and passes it to the workers. Each
worker marks its progress there (joined, runners built); rank 0 waits on those keys while watching the
processes, so a worker that dies at start fails the server's start at once instead of leaving it blocked in
a collective. NCCL on CUDA, gloo on CPU; under ``torchrun`` (the benchmark) :func:`init_from_env` joins
torchrun's group.
On multi-GPU H200 hosts keep ``NCCL_NVLS_ENABLE=0`` (NVLink multicast off).

References: Shoeybi et al., "Megatron-LM" (2019); gpt-fast ``tp.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cloud_server.config import ConfigError, EngineConfig
from cloud_server.engine.model_runner import Batch

HEADER = 8  # [cmd, T, B, block entries, S, flags (1: token ids, 2: rope positions), variant index, H]
F_IDS, F_ROPE = 1, 2
CMD_STOP, CMD_RUN, CMD_NOOP = 0, 1, 2
_KEY = "autoglm/tp"  # the worker ranks' progress keys in the group's store
# Long: an idle server's workers wait in a broadcast (rank 0 also sends heartbeats).
GROUP_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True, slots=True)
class TPShard:
    """A sharded model's place in its group (``model.tp``, set by :func:`shard_model`)."""

    rank: int
    world: int
    group: object = None  # a torch.distributed process group; None: the default group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """In-place sum of ``x`` over the group (NCCL on CUDA, gloo on CPU); returns ``x``."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Every rank's logits shard [N, V / world] -> the full logits [N, vocab_size] (padding trimmed)."""
        n, v_l = local.shape
        gathered = torch.empty((self.world * n, v_l), dtype=local.dtype, device=local.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer name first
        gather(gathered, local.contiguous(), group=self.group)
        full = gathered.view(self.world, n, v_l).permute(1, 0, 2).reshape(n, self.world * v_l)
        return full[:, :vocab_size]


# --------------------------------------------------------------------------------------------
# the sharding pass


class RowParallel(torch.nn.Module):
    """A row-parallel linear: this rank's input-channel shard, then an all-reduce of the partial sums."""

    def __init__(self, linear: torch.nn.Linear, shard: TPShard):
        super().__init__()
        self.linear = linear  # may later be replaced by an Int8Linear (int8 variant)
        self.shard = shard

    @property
    def weight(self) -> torch.Tensor:
        """The shard's weight [out, in / world] (the fast path fuses it; its all-reduce is its own)."""
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shard.all_reduce(self.linear(x))


class VocabParallel(torch.nn.Module):
    """A vocab-parallel lm_head: this rank's rows of the vocabulary, logits all-gathered over the group."""

    def __init__(self, lm_head: torch.nn.Linear, shard: TPShard):
        super().__init__()
        vocab, rows = lm_head.out_features, -(-lm_head.out_features // shard.world)
        part = slice(shard.rank * rows, min((shard.rank + 1) * rows, vocab))

        def cut(t: torch.Tensor) -> torch.Tensor:  # [V, ...] -> this rank's [V / world, ...], zero-padded
            t = t.detach()[part]
            pad = rows - t.shape[0]
            return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t.contiguous()

        self.weight = torch.nn.Parameter(cut(lm_head.weight), requires_grad=False)  # [V / world, H]
        self.bias = None if lm_head.bias is None else torch.nn.Parameter(cut(lm_head.bias), requires_grad=False)
        self.vocab_size, self.shard = vocab, shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V]
        local = F.linear(x, self.weight, self.bias)  # [..., V / world]
        lead = local.shape[:-1]
        return self.shard.gather_vocab(local.reshape(-1, local.shape[-1]), self.vocab_size).reshape(*lead, -1)


def _slice_linear(lin: torch.nn.Linear, rows: slice | None = None, cols: slice | None = None,
                  keep_bias: bool = True) -> torch.nn.Linear:
    w = lin.weight.detach()
    w = w[rows] if rows is not None else w
    w = w[:, cols] if cols is not None else w
    out = torch.nn.Linear(w.shape[1], w.shape[0], bias=lin.bias is not None and keep_bias,
                          dtype=w.dtype, device=w.device)
    out.weight = torch.nn.Parameter(w.contiguous(), requires_grad=False)
    if out.bias is not None:
        b = lin.bias.detach()
        out.bias = torch.nn.Parameter((b[rows] if rows is not None else b).contiguous(), requires_grad=False)
    return out


def _part(n: int, rank: int, world: int, what: str) -> slice:
    if n % world:
        raise ConfigError(f"tensor parallel {world}: {what} ({n}) is not divisible by {world}")
    k = n // world
    return slice(rank * k, (rank + 1) * k)


def shard_model(model, rank: int, world: int, group=None) -> None:
    """Keep rank ``rank``'s shard of a ``CloudModel``'s weights, in place (see the module docstring)."""
    if getattr(model, "tp", None) is not None:
        raise ValueError("model is already sharded")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside [0, {world})")
    shard = TPShard(rank, world, group)
    hd = model.head_dim
    q_heads = _part(model.num_heads, rank, world, "attention heads")
    kv_heads = _part(model.num_kv_heads, rank, world, "KV heads")
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = _slice_linear(attn.q_proj, rows=slice(q_heads.start * hd, q_heads.stop * hd))
        attn.k_proj = _slice_linear(attn.k_proj, rows=slice(kv_heads.start * hd, kv_heads.stop * hd))
        attn.v_proj = _slice_linear(attn.v_proj, rows=slice(kv_heads.start * hd, kv_heads.stop * hd))
        cols = slice(q_heads.start * hd, q_heads.stop * hd)
        attn.o_proj = RowParallel(_slice_linear(attn.o_proj, cols=cols, keep_bias=rank == 0), shard)
        if hasattr(attn, "num_heads"):
            attn.num_heads = q_heads.stop - q_heads.start
        if hasattr(attn, "num_key_value_heads"):
            attn.num_key_value_heads = kv_heads.stop - kv_heads.start
        if hasattr(mlp, "gate_up_proj"):  # GLM: fused [gate; up], each half sharded alike
            inter = mlp.gate_up_proj.weight.shape[0] // 2
            s = _part(inter, rank, world, "intermediate size")
            gate = _slice_linear(mlp.gate_up_proj, rows=s)
            up = _slice_linear(mlp.gate_up_proj, rows=slice(inter + s.start, inter + s.stop))
            fused = torch.nn.Linear(gate.in_features, 2 * gate.out_features, bias=False,
                                    dtype=gate.weight.dtype, device=gate.weight.device)
            fused.weight = torch.nn.Parameter(torch.cat([gate.weight, up.weight]), requires_grad=False)
            mlp.gate_up_proj = fused
        else:  # Llama layout
            inter = mlp.gate_proj.weight.shape[0]
            s = _part(inter, rank, world, "intermediate size")
            mlp.gate_proj = _slice_linear(mlp.gate_proj, rows=s)
            mlp.up_proj = _slice_linear(mlp.up_proj, rows=s)
        s = _part(mlp.down_proj.weight.shape[1], rank, world, "intermediate size")
        mlp.down_proj = RowParallel(_slice_linear(mlp.down_proj, cols=s, keep_bias=rank == 0), shard)
    model.lm_head = VocabParallel(model.lm_head, shard)
    model.num_heads //= world
    model.num_kv_heads //= world
    model.tp = shard


# --------------------------------------------------------------------------------------------
# the batch on the wire between ranks


def broadcast_batch(batch: Batch | None, variant_idx: int, hidden_size: int, device, cmd: int = CMD_RUN) -> None:
    """Rank 0: send ``cmd`` (and for CMD_RUN, the batch) to every rank."""
    if cmd != CMD_RUN:
        dist.broadcast(torch.tensor([cmd] + [0] * (HEADER - 1), dtype=torch.long, device=device), 0)
        return
    lens = [len(t) for t in batch.block_tables]
    entries = [b for t in batch.block_tables for b in t]
    flags = (F_IDS if batch.hidden is None else 0) | (F_ROPE if batch.rope_positions is not None else 0)
    header = torch.tensor([CMD_RUN, batch.num_tokens, len(lens), len(entries), len(batch.logits_indices), flags,
                           variant_idx, hidden_size], dtype=torch.long)
    parts = [batch.positions, batch.slot_mapping, torch.tensor(batch.query_lens), torch.tensor(batch.context_lens),
             torch.tensor(lens), torch.tensor(entries, dtype=torch.long), batch.logits_indices]
    if flags & F_IDS:
        parts.append(batch.input_ids)
    if flags & F_ROPE:
        parts.append(batch.rope_positions)  # [3, T]
    ints = torch.cat([p.to(torch.long).reshape(-1) for p in parts])
    dist.broadcast(header.to(device), 0)
    dist.broadcast(ints.to(device), 0)
    if not flags & F_IDS:
        dist.broadcast(batch.hidden.float().contiguous().to(device), 0)


def receive_batch(device) -> tuple[int, Batch | None, int]:
    """Ranks > 0: (cmd, batch, variant index). The hidden states stay on ``device``."""
    header = torch.empty(HEADER, dtype=torch.long, device=device)
    dist.broadcast(header, 0)
    cmd, t, b, e, s, flags, variant_idx, h = (int(x) for x in header.cpu())
    if cmd != CMD_RUN:
        return cmd, None, 0
    sizes = [t, t, b, b, b, e, s, t if flags & F_IDS else 0, 3 * t if flags & F_ROPE else 0]
    ints = torch.empty(sum(sizes), dtype=torch.long, device=device)
    dist.broadcast(ints, 0)
    ints = ints.cpu()
    pos, slots, qlens, clens, tlens, entries, rows, ids, rope = torch.split(ints, sizes)
    tables, i = [], 0
    for n in tlens.tolist():
        tables.append(entries[i:i + n].tolist())
        i += n
    hidden = None
    if not flags & F_IDS:
        hidden = torch.empty(t, h, dtype=torch.float32, device=device)  # [T, H]
        dist.broadcast(hidden, 0)
    return cmd, Batch(positions=pos, slot_mapping=slots, query_lens=qlens.tolist(), context_lens=clens.tolist(),
                      block_tables=tables, logits_indices=rows, hidden=hidden,
                      input_ids=ids if flags & F_IDS else None,
                      rope_positions=rope.reshape(3, t) if flags & F_ROPE else None), variant_idx


class BroadcastingRunner:
    """Rank 0's runner under TP: broadcast each batch to the workers, then run this rank's shard with ``runner``
    (a ``ModelRunner`` or ``FastGlmRunner`` over the sharded model; the logits it returns are complete)."""

    def __init__(self, runner, variant_idx: int, comm_device: torch.device):
        self.runner, self.variant_idx, self.comm_device = runner, variant_idx, comm_device
        self.model, self.pool = runner.model, runner.pool
        self.reserved_blocks = tuple(getattr(runner, "reserved_blocks", ()))

    def run(self, batch: Batch) -> torch.Tensor:
        broadcast_batch(batch, self.variant_idx, self.model.hidden_size, self.comm_device)
        return self.runner.run(batch)


def serve_batches(runners: list, comm_device: torch.device) -> None:
    """Ranks > 0: run every batch rank 0 broadcasts on the runner of its variant, until told to stop."""
    while True:
        cmd, batch, vi = receive_batch(comm_device)
        if cmd == CMD_STOP:
            return
        if cmd == CMD_RUN:
            runners[vi].run(batch)


def heartbeat(comm_device: torch.device) -> None:
    """Rank 0, idle: wake the workers' broadcast before its timeout."""
    broadcast_batch(None, 0, 0, comm_device, CMD_NOOP)


def stop_workers(comm_device: torch.device) -> None:
    broadcast_batch(None, 0, 0, comm_device, CMD_STOP)


# --------------------------------------------------------------------------------------------
# process group and workers


def rank_device(device: str, rank: int) -> str:
    return f"cuda:{rank}" if device.startswith("cuda") else "cpu"


def comm_device(device: str, rank: int) -> torch.device:
    """Where collectives' tensors live: the rank's GPU under NCCL, the host under gloo."""
    return torch.device(rank_device(device, rank))


def _join(store: dist.Store, rank: int, world: int, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", store=store, rank=rank,
                            world_size=world, timeout=GROUP_TIMEOUT)


def open_group(world: int, host: str = "127.0.0.1") -> tuple[dist.TCPStore, int]:
    """Rank 0, step 1: the group's store, listening on a port the OS picks; returns (store, port)."""
    store = dist.TCPStore(host, 0, world, is_master=True, timeout=GROUP_TIMEOUT, wait_for_workers=False)
    return store, store.port


def _await_workers(store: dist.TCPStore, procs: list[subprocess.Popen], key: str, what: str) -> None:
    """Wait until every worker rank has set ``key`` in the store; a worker that exits first fails the wait
    (and the others are stopped) instead of leaving rank 0 blocked for the group's timeout. The store is polled
    (``check``, which returns at once): a ``wait`` with a timeout logged two c10d warnings ("waitForInput ...
    timed out") every second a worker was still loading."""
    for rank, proc in enumerate(procs, start=1):
        while not store.check([f"{_KEY}/{key}/{rank}"]):  # not set yet: is the worker still there?
            code = proc.poll()
            if code is not None:
                for other in procs:
                    if other.poll() is None:
                        other.kill()
                raise RuntimeError(f"tensor-parallel worker rank {rank} exited (code {code}) before {what}; "
                                   f"its error is in the log above")
            time.sleep(0.05)


def join_group(store: dist.TCPStore, world: int, device: str, procs: list[subprocess.Popen]) -> None:
    """Rank 0, step 2 (after the workers are started): join the group; returns when every rank has."""
    _await_workers(store, procs, "joined", "joining the group")
    _join(store, 0, world, device)


def await_ready(store: dist.TCPStore, procs: list[subprocess.Popen]) -> None:
    """Rank 0, step 3 (its own runners built): wait for the workers' (raises if one has exited), then meet them
    at a barrier."""
    _await_workers(store, procs, "ready", "its runners were built")
    dist.barrier()


def init_from_env(device_type: str) -> tuple[int, int]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT); returns (rank, world)."""
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise RuntimeError(f"tensor parallel needs torchrun's environment ({key} is unset)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device_type == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()),
                                timeout=GROUP_TIMEOUT)
    else:
        dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
    return rank, world


def load_models(source_kind: str, source: str, variants: list[str], device: str, rank: int, world: int):
    """This rank's sharded models, one per variant, in ``variants`` order."""
    from cloud_server.model import load_full_model, load_split_model

    shard = (lambda m: shard_model(m, rank, world)) if world > 1 else None
    if source_kind == "bundle":
        return [load_split_model(source, v, device, shard=shard) for v in variants]
    from partition_tools.models import load_model

    lm = load_model(source)
    return [load_full_model(lm, v, device, shard=shard) for v in variants]


def launch_workers(world: int, master_addr: str, master_port: int, source_kind: str, source: str,
                   variants: list[str], engine: EngineConfig) -> list[subprocess.Popen]:
    """Start ranks 1..world-1 as subprocesses (plain argv, the engine config as JSON; nothing pickled).

    Each in a session of its own: Ctrl-C in a terminal signals the whole foreground process group, and a worker
    in it died of a ``KeyboardInterrupt`` traceback in its broadcast while rank 0 was still draining (its open
    requests need every rank). Rank 0 alone takes the signal; its shutdown stops the workers (``CMD_STOP``)."""
    config = json.dumps(asdict(engine))
    procs = []
    for rank in range(1, world):
        cmd = [sys.executable, "-m", "cloud_server.tp", "--rank", str(rank), "--world", str(world),
               "--master-addr", master_addr, "--master-port", str(master_port), f"--{source_kind}", source,
               "--variants", ",".join(variants), "--engine-config", config]
        procs.append(subprocess.Popen(cmd, env=dict(os.environ), start_new_session=True))
    return procs


def worker_main(argv: list[str] | None = None) -> int:
    """Entry point of ranks > 0: load the shard, build the runners, then run every batch rank 0 broadcasts
    until told to stop."""
    from cloud_server.engine.kv_cache import KVCachePool
    from cloud_server.fast.runner import fast_runner_factory

    ap = argparse.ArgumentParser(prog="python -m cloud_server.tp", description="tensor-parallel worker rank")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--master-port", type=int, required=True)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--bundle")
    src.add_argument("--full")
    ap.add_argument("--variants", required=True)
    ap.add_argument("--engine-config", required=True, help="the rank-0 EngineConfig as JSON")
    a = ap.parse_args(argv)
    ecfg = EngineConfig(**json.loads(a.engine_config))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // a.world))
    device = rank_device(ecfg.device, a.rank)
    store = dist.TCPStore(a.master_addr, a.master_port, a.world, is_master=False, timeout=GROUP_TIMEOUT)
    store.set(f"{_KEY}/joined/{a.rank}", "1")
    _join(store, a.rank, a.world, ecfg.device)
    kind, source = ("bundle", a.bundle) if a.bundle else ("full", a.full)
    models = load_models(kind, source, a.variants.split(","), device, a.rank, a.world)
    make_runner = fast_runner_factory(ecfg)
    runners = [make_runner(i, m, KVCachePool(m.num_layers, ecfg.num_blocks, ecfg.block_size, m.num_kv_heads,
                                             m.head_dim, m.dtype, device, ecfg.kv_cache_dtype))
               for i, m in enumerate(models)]
    store.set(f"{_KEY}/ready/{a.rank}", "1")
    dist.barrier()  # runners built on every rank
    serve_batches(runners, comm_device(ecfg.device, a.rank))
    exit_rank(0)


def exit_rank(code: int = 0) -> None:
    """End a rank process that is done with its group: leave the group, then exit *without* interpreter
    teardown. At teardown gloo's C++ threads may still be joinable, and their destructors call
    ``std::terminate`` ("terminate called without an active exception", SIGABRT, exit -6): a rank whose work
    succeeded then fails now and then, more often on a loaded machine (the flaky torchrun test had this)."""
    try:
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - a peer (or the store's host) may already be gone
        print(f"tp rank: destroy_process_group: {e}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(worker_main())
