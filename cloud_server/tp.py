"""Tensor parallelism over 2 ranks: a separate pass that shards a plain model, plus the rank protocol.

Sharding (gpt-fast's ``tp.py`` idea: no second model implementation). For each of the library's decoder
layers, in place:

* column-parallel: ``q_proj``, ``k_proj``, ``v_proj`` (whole heads, with their biases), ``gate_proj`` /
  ``up_proj`` or the fused ``gate_up_proj`` (each half split on its own);
* row-parallel: ``o_proj`` and ``down_proj`` take their input-channel shard and all-reduce their output
  (:class:`RowParallel`; a bias is added once, on rank 0).

The attention modules size their heads from the projection output (``view(..., -1, head_dim)``), so each
rank runs ``heads / tp`` query heads over ``kv_heads / tp`` KV heads of its own KV pool. GLM-4.1V has 2 KV
heads: TP = 2 shards them exactly. Norms, embeddings and the lm_head stay whole; only rank 0 computes logits.

Rank protocol. Rank 0 owns the network, the scheduler and the sampler. Every forward pass it broadcasts the
flat batch (``cloud_server.engine.model_runner.Batch``) as fixed-layout tensors: an int64 header, one int64
tensor with the positions, slots, lengths, block tables and logits rows, and the float32 hidden states.
No pickle crosses the process boundary, and workers are started as plain subprocesses
(``python -m cloud_server.tp --rank 1 ...``) that load their own weights. NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from cloud_server.config import ConfigError
from cloud_server.engine.model_runner import Batch, ModelRunner

HEADER = 8  # [cmd, T, B, block entries, S, flags (1: token ids, 2: rope positions), variant index, H]
F_IDS, F_ROPE = 1, 2
CMD_STOP, CMD_RUN, CMD_NOOP = 0, 1, 2


class RowParallel(torch.nn.Module):
    """A row-parallel linear: this rank's input-channel shard, then an all-reduce of the partial sums."""

    def __init__(self, linear: torch.nn.Linear, group=None):
        super().__init__()
        self.linear = linear  # may later be replaced by an Int8Linear (int8 variant)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        dist.all_reduce(y, group=self.group)
        return y


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


def _shard(n: int, rank: int, world: int, what: str) -> slice:
    if n % world:
        raise ConfigError(f"tensor parallel {world}: {what} ({n}) is not divisible by {world}")
    k = n // world
    return slice(rank * k, (rank + 1) * k)


def shard_model(model, rank: int, world: int, group=None) -> None:
    """Shard a :class:`~cloud_server.model.CloudModel`'s decoder layers in place (see the module docstring)."""
    hd = model.head_dim
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q_heads = _shard(model.num_heads, rank, world, "attention heads")
        kv_heads = _shard(model.num_kv_heads, rank, world, "KV heads")
        attn.q_proj = _slice_linear(attn.q_proj, rows=slice(q_heads.start * hd, q_heads.stop * hd))
        attn.k_proj = _slice_linear(attn.k_proj, rows=slice(kv_heads.start * hd, kv_heads.stop * hd))
        attn.v_proj = _slice_linear(attn.v_proj, rows=slice(kv_heads.start * hd, kv_heads.stop * hd))
        cols = slice(q_heads.start * hd, q_heads.stop * hd)
        attn.o_proj = RowParallel(_slice_linear(attn.o_proj, cols=cols, keep_bias=rank == 0), group)
        if hasattr(attn, "num_heads"):
            attn.num_heads = q_heads.stop - q_heads.start
        if hasattr(attn, "num_key_value_heads"):
            attn.num_key_value_heads = kv_heads.stop - kv_heads.start
        if hasattr(mlp, "gate_up_proj"):  # GLM: fused [gate; up], each half sharded alike
            inter = mlp.gate_up_proj.weight.shape[0] // 2
            s = _shard(inter, rank, world, "intermediate size")
            gate = _slice_linear(mlp.gate_up_proj, rows=s)
            up = _slice_linear(mlp.gate_up_proj, rows=slice(inter + s.start, inter + s.stop))
            fused = torch.nn.Linear(gate.in_features, 2 * gate.out_features, bias=False,
                                    dtype=gate.weight.dtype, device=gate.weight.device)
            fused.weight = torch.nn.Parameter(torch.cat([gate.weight, up.weight]), requires_grad=False)
            mlp.gate_up_proj = fused
        else:  # Llama layout
            inter = mlp.gate_proj.weight.shape[0]
            s = _shard(inter, rank, world, "intermediate size")
            mlp.gate_proj = _slice_linear(mlp.gate_proj, rows=s)
            mlp.up_proj = _slice_linear(mlp.up_proj, rows=s)
        s = _shard(mlp.down_proj.weight.shape[1], rank, world, "intermediate size")
        mlp.down_proj = RowParallel(_slice_linear(mlp.down_proj, cols=s, keep_bias=rank == 0), group)
    model.num_heads //= world
    model.num_kv_heads //= world


# --------------------------------------------------------------------------------------------
# the batch on the wire between ranks


def _comm_device(runner: ModelRunner) -> torch.device:
    return runner.device if dist.get_backend() == "nccl" else torch.device("cpu")


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
    """Ranks > 0: (cmd, batch, variant index)."""
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
        hidden = torch.empty(t, h, dtype=torch.float32, device=device)
        dist.broadcast(hidden, 0)
        hidden = hidden.cpu()
    batch = Batch(positions=pos, slot_mapping=slots, query_lens=qlens.tolist(), context_lens=clens.tolist(),
                  block_tables=tables, logits_indices=rows, hidden=hidden,
                  input_ids=ids if flags & F_IDS else None,
                  rope_positions=rope.reshape(3, t) if flags & F_ROPE else None)
    return cmd, batch, variant_idx


class TPModelRunner(ModelRunner):
    """Rank 0's runner: broadcast the batch, then run this rank's shard like any runner."""

    def __init__(self, model, pool, batch_invariant: bool = True, variant_idx: int = 0):
        super().__init__(model, pool, batch_invariant=batch_invariant)
        self.variant_idx = variant_idx

    def run(self, batch: Batch):
        broadcast_batch(batch, self.variant_idx, self.model.hidden_size, _comm_device(self))
        return super().run(batch)

    def heartbeat(self) -> None:
        broadcast_batch(None, 0, 0, _comm_device(self), CMD_NOOP)

    def stop_workers(self) -> None:
        broadcast_batch(None, 0, 0, _comm_device(self), CMD_STOP)


# --------------------------------------------------------------------------------------------
# process group and workers


def init_group(rank: int, world: int, master_addr: str, master_port: int, device: str) -> None:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # Long timeout: an idle server's workers wait in a broadcast (rank 0 also sends heartbeats).
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world, timeout=timedelta(minutes=30))


def rank_device(device: str, rank: int) -> str:
    return f"cuda:{rank}" if device.startswith("cuda") else "cpu"


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
                   variants: list[str], device: str, num_blocks: int, block_size: int) -> list[subprocess.Popen]:
    """Start ranks 1..world-1 as subprocesses (plain argv; nothing pickled)."""
    procs = []
    for rank in range(1, world):
        cmd = [sys.executable, "-m", "cloud_server.tp", "--rank", str(rank), "--world", str(world),
               "--master-addr", master_addr, "--master-port", str(master_port), f"--{source_kind}", source,
               "--variants", ",".join(variants), "--device", device, "--num-blocks", str(num_blocks),
               "--block-size", str(block_size)]
        procs.append(subprocess.Popen(cmd, env=dict(os.environ)))
    return procs


def worker_main(argv: list[str] | None = None) -> int:
    """Entry point of ranks > 0: load the shard, then run every batch rank 0 broadcasts until told to stop."""
    from cloud_server.engine.kv_cache import KVCachePool

    ap = argparse.ArgumentParser(prog="python -m cloud_server.tp", description="tensor-parallel worker rank")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--master-port", type=int, required=True)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--bundle")
    src.add_argument("--full")
    ap.add_argument("--variants", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-blocks", type=int, required=True)
    ap.add_argument("--block-size", type=int, required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // a.world))
    device = rank_device(a.device, a.rank)
    init_group(a.rank, a.world, a.master_addr, a.master_port, a.device)
    kind, source = ("bundle", a.bundle) if a.bundle else ("full", a.full)
    models = load_models(kind, source, a.variants.split(","), device, a.rank, a.world)
    runners = [ModelRunner(m, KVCachePool(m.num_layers, a.num_blocks, a.block_size, m.num_kv_heads, m.head_dim,
                                          m.dtype, device), compute_logits=False) for m in models]
    comm = torch.device(device) if a.device.startswith("cuda") else torch.device("cpu")
    dist.barrier()  # models loaded on every rank
    while True:
        cmd, batch, vi = receive_batch(comm)
        if cmd == CMD_STOP:
            break
        if cmd == CMD_RUN:
            runners[vi].run(batch)
    try:
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - rank 0 (the store's host) may already be gone
        print(f"tp worker {a.rank}: destroy_process_group: {e}", file=sys.stderr)
    # Leave without interpreter teardown: gloo's C++ threads may still be joinable then, and their
    # destructors call std::terminate (SIGABRT) when rank 0 has closed the store first.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(worker_main())
