"""The one version string: the installed distribution's (pyproject.toml), reported by both ends."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("autoglm-split")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
