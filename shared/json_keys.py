"""JSON objects whose keys are each given once: ``json.loads(text, object_pairs_hook=unique_keys)``.

Python's ``json`` keeps the last of a key given twice without a word (``{"port": 1, "port": 2}`` served on 2); the
files people write by hand - the cloud's ``--config``, the rig's JSON scenarios - refuse it, as TOML and the rig's
YAML loader do.
"""

from __future__ import annotations


def unique_keys(pairs: list) -> dict:
    """The object of ``pairs``; ValueError naming a key given twice."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} given twice")
        out[key] = value
    return out
