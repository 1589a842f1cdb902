"""A benchmark's saved JSON read back for ``--report``: its configuration restored onto the arguments."""
from __future__ import annotations

import json


def load_saved(a, path: str) -> dict:
    """The run saved at ``path``; its ``config`` is set onto ``a`` (all but ``report``, ``json`` and
    ``plot``), so the tables are printed as that run printed them."""
    with open(path) as fh:
        saved = json.load(fh)
    for key, value in saved["config"].items():
        if key not in ("report", "json", "plot"):
            setattr(a, key, value)
    return saved
