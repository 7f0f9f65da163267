"""The hand-written GLM-4 / GLM-4.1V-text fast path for the cloud half (gpt-fast style, plain PyTorch + Triton).

Modules, one concept each:

* ``config``    - :class:`FastGLMConfig`, the shapes the fast path needs, read from a transformers text config;
* ``glm``       - :class:`FastGLM`: the back-half decoder layers with fused QKV and gate-up weights;
* ``kernels``   - fused RMSNorm / residual / SiLU-mul / RoPE + KV-store kernels (Triton on CUDA, torch elsewhere);
* ``attention`` - paged decode attention (split-K flash-decoding in Triton) and prefill attention (SDPA);
* ``linear``    - Triton weight-streaming GEMV / skinny GEMM, chosen per shape against cuBLAS by measurement;
* ``kv``        - the engine's paged KV pool seen block-wise;
* ``graphs``    - CUDA graphs captured per decode batch bucket;
* ``tuning``    - startup timing of the projection and decode-attention kernels on the GPU at hand;
* ``runner``    - :class:`FastGlmRunner`, the ``run(batch) -> logits`` adapter the serving engine selects.

Tensor parallelism is not a second implementation: ``cloud_server.tp.shard_model`` shards the library's layers
and :class:`FastGLM` fuses the shards. The same code runs on the CPU (torch kernels, no graphs): that is how
the tests check it against the library's own layers, and serve it at TP = 2 over gloo.
"""

from .config import FastGLMConfig, UnsupportedFastPath
from .glm import FastGLM

__all__ = ["FastGLM", "FastGLMConfig", "UnsupportedFastPath"]
