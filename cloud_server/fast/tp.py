"""Tensor parallelism for a built :class:`FastGLM`: a separate pass that keeps this rank's shard of each weight.

Megatron-style: the fused QKV and gate-up products are column-parallel (each rank owns ``heads / tp`` query
heads, ``kv_heads / tp`` KV heads and ``intermediate / tp`` MLP channels), the output and down products are
row-parallel and followed by one all-reduce each, so a layer costs two all-reduces of [T, H]; norms and the
residual stream are replicated. The lm_head is split over the vocabulary and the logits all-gathered. Each
rank's KV pool then holds only its own KV heads: GLM-4.1V's 2 KV heads split exactly over 2 GPUs, which
halves both the weights and the cache per GPU.

Ranks talk through ``torch.distributed`` (NCCL on CUDA, gloo on CPU for the tests); collectives are issued
inside the captured decode graphs. Nothing is pickled: every rank builds the same model from the same bundle
or seed and keeps its slice. Launch with ``torchrun --nproc-per-node 2``. On multi-GPU H200 hosts keep
``NCCL_NVLS_ENABLE=0`` (NVLink multicast off).

References: Shoeybi et al., "Megatron-LM" (2019); gpt-fast ``tp.py``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .glm import FastGLM


def _rows(t: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return t[start:start + size]


def _keep(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    param.data = value.clone(memory_format=torch.contiguous_format)  # a copy: the full tensor is freed


@torch.no_grad()
def shard_model(model: FastGLM, rank: int, world_size: int, group=None) -> FastGLM:
    """Keep rank ``rank``'s shard of every weight, in place; returns ``model``."""
    cfg = model.cfg
    if model.tp_size != 1:
        raise ValueError("model is already sharded")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    for name, n in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads),
                    ("intermediate_size", cfg.intermediate_size)):
        if n % world_size:
            raise ValueError(f"{name}={n} does not split over {world_size} tensor-parallel ranks")
    if world_size == 1:
        return model
    q_l, kv_l = cfg.q_size // world_size, cfg.kv_size // world_size  # rows per rank
    i_l = cfg.intermediate_size // world_size

    def qkv_rows(t):  # [(Hq + 2 KVH) D, ...] -> this rank's q, k, v rows, fused again
        q = _rows(t, rank * q_l, q_l)
        k = _rows(t, cfg.q_size + rank * kv_l, kv_l)
        v = _rows(t, cfg.q_size + cfg.kv_size + rank * kv_l, kv_l)
        return torch.cat([q, k, v])

    for layer in model.layers:
        _keep(layer.qkv_weight, qkv_rows(layer.qkv_weight))
        if layer.qkv_bias is not None:
            _keep(layer.qkv_bias, qkv_rows(layer.qkv_bias))
        _keep(layer.o_weight, layer.o_weight[:, rank * q_l: (rank + 1) * q_l])
        gu = layer.gate_up_weight
        _keep(layer.gate_up_weight, torch.cat([_rows(gu, rank * i_l, i_l),
                                               _rows(gu, cfg.intermediate_size + rank * i_l, i_l)]))
        _keep(layer.down_weight, layer.down_weight[:, rank * i_l: (rank + 1) * i_l])
    v = cfg.vocab_size
    v_l = -(-v // world_size)
    head = model.lm_head_weight[rank * v_l: min((rank + 1) * v_l, v)]
    if head.shape[0] < v_l:  # pad the last shard; compute_logits trims the padding columns
        head = torch.cat([head, head.new_zeros(v_l - head.shape[0], head.shape[1])])
    _keep(model.lm_head_weight, head)
    model.tp_rank, model.tp_size, model.tp_group = rank, world_size, group
    model.all_reduce = NcclAllReduce(group)
    return model


class NcclAllReduce:
    """In-place sum over the group through ``torch.distributed`` (NCCL on CUDA, gloo on CPU)."""

    name = "nccl"

    def __init__(self, group=None):
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x


class SymmMemAllReduce:
    """One-shot all-reduce through PyTorch symmetric memory for small (decode) inputs, NCCL above ``max_rows``.

    At decode sizes (a few KB per rank) an NCCL all-reduce costs ~9 us inside a CUDA graph, two calls a layer;
    the one-shot kernel copies the local input into a symmetric staging buffer, meets its peers at a barrier
    and reads their buffers over NVLink directly (no multicast needed, so it runs with
    ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``), all in one kernel.
    """

    name = "symm_mem"

    def __init__(self, group, max_rows: int, hidden: int, dtype: torch.dtype, device):
        from torch.distributed import _symmetric_memory as symm_mem

        self.group = group or dist.group.WORLD
        self.group_name = self.group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # required by older releases, deprecated (a no-op) in newer ones
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group_name)
        self.max_rows = max_rows
        self.buf = symm_mem.empty(max_rows, hidden, dtype=dtype, device=device)  # [R, H]
        symm_mem.rendezvous(self.buf, self.group)
        self.nccl = NcclAllReduce(group)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        if t > self.max_rows:
            return self.nccl(x)
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(self.buf[:t], x, "sum", self.group_name, out)
        return out


def init_from_env(device_type: str) -> tuple[int, int]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT); returns (rank, world)."""
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise RuntimeError(f"tensor parallel needs torchrun's environment ({key} is unset)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device_type == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")
    return rank, world
