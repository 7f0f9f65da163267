"""Step-by-step progress for long partition work (split, verify, plan, draft-head): one line per step on stderr,
with elapsed time.

Quiet when stderr is not a terminal unless ``AUTOGLM_PROGRESS=1`` (CI logs stay short).
"""

from __future__ import annotations

import os
import sys
import time


def enabled() -> bool:
    flag = os.environ.get("AUTOGLM_PROGRESS")
    if flag is not None:
        return flag not in ("0", "")
    return sys.stderr.isatty()


def quiet_library_bars() -> None:
    """The libraries' own progress bars (transformers' 'Loading weights', 'Converting and de-quantizing GGUF
    tensors') follow the same rule: off when :func:`enabled` is not (they filled CI logs with carriage returns)."""
    if not enabled():
        os.environ.setdefault("TQDM_DISABLE", "1")  # tqdm's own default for every bar (transformers' are tqdm)


class Steps:
    def __init__(self, total: int, label: str):
        self.total, self.label, self.i = total, label, 0
        self.t0 = self.t_step = time.perf_counter()
        self.on = enabled()

    def next(self, what: str) -> None:
        self.i += 1
        now = time.perf_counter()
        if self.on:
            print(f"[{self.label} {self.i}/{self.total}] {what} (+{now - self.t0:.1f}s)", file=sys.stderr, flush=True)
        self.t_step = now

    def done(self, seconds: float) -> None:
        if self.on:
            print(f"[{self.label}] done in {seconds:.1f}s", file=sys.stderr, flush=True)
