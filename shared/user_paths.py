"""One rule for the paths an operator writes outside a shell: a config file, a scenario, an environment variable.

``~`` and ``~user`` mean a home directory there as on a shell's command line; a ``~name`` that is no user stays as
written (a shell's rule; ``Path.expanduser`` raised RuntimeError for it).
"""

from __future__ import annotations

import os
from pathlib import Path


def user_path(value: str | os.PathLike) -> Path:
    """``value`` as a :class:`Path`, its leading ``~`` / ``~user`` expanded as a shell would."""
    return Path(os.path.expanduser(value))
