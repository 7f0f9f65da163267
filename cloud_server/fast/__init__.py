"""The hand-written GLM-4 / GLM-4.1V-text fast path for the cloud half (gpt-fast style, plain PyTorch + Triton).

Modules, one concept each:

* ``config``    - :class:`FastGLMConfig`, the shapes the fast path needs, read from a transformers text config;
* ``glm``       - :class:`FastGLM`: the back-half decoder layers with fused QKV and gate-up weights;
* ``kernels``   - fused RMSNorm / residual / SiLU-mul / RoPE + KV-store kernels (Triton on CUDA, torch elsewhere);
* ``attention`` - paged decode attention (split-K flash-decoding in Triton) and prefill attention (SDPA);
* ``linear``    - Triton weight-streaming GEMV / skinny GEMM, chosen per shape against cuBLAS by measurement;
* ``kv``        - the static paged KV pool on the GPU and a minimal block allocator;
* ``graphs``    - CUDA graphs captured per decode batch bucket;
* ``tp``        - tensor-parallel sharding of a built :class:`FastGLM` (column/row parallel + all-reduce);
* ``runner``    - :class:`FastGlmRunner`, the ``run(batch) -> logits`` adapter the serving engine selects.

The same code runs on the CPU with tiny configs (torch kernels, no graphs): that is how the tests check it
against the library's own layers.
"""

from .config import FastGLMConfig, UnsupportedFastPath
from .glm import FastGLM

__all__ = ["FastGLM", "FastGLMConfig", "UnsupportedFastPath"]
