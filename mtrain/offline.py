"""Offline settings shared by the command line and the config checks: mtrain never reaches the model hub unless
asked (`mtrain --online ...` or MTRAIN_ONLINE=1).

A leaf module (it imports nothing of mtrain): `mtrain.cli` sets the variables before any stage imports the hub
libraries, and `mtrain.config` reads them to tell a missing local path from a hub id it may not fetch.
"""

from __future__ import annotations

import os

# The hub libraries read these at import: set before any stage imports them. `--online` (or MTRAIN_ONLINE=1)
# lets transformers / datasets reach the model hub; without it a path that is not on disk fails at once.
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def set_offline(argv: list[str]) -> bool:
    """Offline unless `--online` comes before the subcommand or MTRAIN_ONLINE=1; returns whether online.

    Variables the user set explicitly are kept (HF_HUB_OFFLINE=0 stays online).
    """
    head = argv[: next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))]
    online = "--online" in head or os.environ.get("MTRAIN_ONLINE") == "1"
    if not online:
        for name in OFFLINE_VARS:
            os.environ.setdefault(name, "1")
    return online


def hub_offline() -> bool:
    """Whether any of OFFLINE_VARS is set to a true value (1, true, yes, on) in this process's environment."""
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in OFFLINE_VARS)
