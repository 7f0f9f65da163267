"""The one bound on the compute threads a process may ask for: 1 to ``MAX_THREADS``.

Every ``--threads``-like setting (autoglm-edge's ``--threads``/``EdgeConfig.threads``, autoglm-partition plan's
``--edge-threads``/``--cloud-threads``, the rig's threads per phone) is checked here before anything loads: past it
onnxruntime spent minutes starting 100,000 threads and torch.set_num_threads(1,000,000) crashed the process.
"""

from __future__ import annotations

MAX_THREADS = 256


def threads_problem(n: object) -> str | None:
    """None when ``n`` is a thread count a runtime may be given, else what is wrong with it."""
    if type(n) is not int or not 1 <= n <= MAX_THREADS:
        return f"must be >= 1 and <= {MAX_THREADS} (an integer), got {n!r}"
    return None
