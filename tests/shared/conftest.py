"""tests/shared: the wire protocol, codecs, bounded zstd and the precision policy (numpy only, no torch)."""

from __future__ import annotations

import sys
from pathlib import Path

# protocol_strategies.py imports as a top-level module under any import mode
sys.path.insert(0, str(Path(__file__).parent))
