"""Where the workplace's shared, labelled runs live (``../shared`` beside the checkout).

Set ``STABILITY_SHARED_DIR`` to point elsewhere. Tests that need these runs skip when they are
absent; CI must have them (``.ci/run`` checks and says so).
"""

from __future__ import annotations

import os
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]


def _locate() -> Path:
    env = os.environ.get("STABILITY_SHARED_DIR")
    candidates = [Path(env)] if env else []
    candidates.append(_REPO.parent / "shared")
    for c in candidates:
        if (c / "runs").exists() or (c / "realruns").exists():
            return c
    return candidates[0]


SHARED = _locate()
PUBLIC = SHARED / "runs" / "public"
PUBLIC_RUNS = PUBLIC / "runs"
PUBLIC_LABELS = PUBLIC / "labels.parquet"
