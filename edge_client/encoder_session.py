"""An encoder graph (``edge/vision.onnx``, ``edge/audio.onnx``) opened on first use.

Encoders load lazily so a text-only app never pays their memory; :class:`LazySession` is the one place that
does it for every encoder: thread-safe first open (``edge_client.front.open_session``, the phone's session
options), a clear ``MediaError("no_encoder")`` when the bundle lacks the graph, and a count of its runs (a session runs
in several threads at once: requests' media are encoded side by side). :class:`LazyEncoder` is the base of
``VisionEncoder`` and ``AudioEncoder``.

Only onnxruntime: this module runs on the phone.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np


class LazySession:
    """One encoder graph at ``path``, opened by the first :meth:`run` (or :meth:`open`)."""

    def __init__(self, path: str | Path, threads: int, what: str):
        """``what`` names the encoder in the error when the graph is missing (e.g. ``"a vision encoder"``)."""
        self.path = Path(path)
        self.threads = threads
        self.what = what
        self.runs = 0
        self._session = None
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._session is not None

    def open(self):
        """The onnxruntime session, opened now if it is not yet (MediaError ``no_encoder`` if the file is missing)."""
        with self._lock:
            if self._session is None:
                from .front import open_session
                from .vision import MediaError  # vision imports this module

                if not self.path.is_file():
                    raise MediaError(f"{self.path}: missing (bundle without {self.what})", "no_encoder")
                self._session = open_session(self.path, self.threads)
        return self._session

    def run(self, output: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
        """The graph's ``output`` for ``feeds``."""
        out = self.open().run([output], feeds)[0]
        self.runs += 1
        return out


class LazyEncoder:
    """What every encoder of a bundle shares: its graph (:class:`LazySession`, set by the subclass) and what
    the client reads from it."""

    graph: LazySession

    @property
    def loaded(self) -> bool:
        return self.graph.loaded
