"""How a benchmark hands back its result: the command that produced it, the JSON on stdout, and a file."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def emit(result: dict, out: Path | None, script: str, argv: list[str] | None) -> None:
    """Record ``python bench/<script> ARGS`` as ``result["command"]``, print the JSON, write it to ``out``."""
    result["command"] = f"python bench/{script} " + " ".join(argv if argv is not None else sys.argv[1:])
    text = json.dumps(result, indent=1)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)
