"""Latency summaries of the soak's reports."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["summarize_ms"]


def summarize_ms(seconds: Sequence[float]) -> dict[str, float | int | None]:
    """n, p50, p99 and max in milliseconds (None when empty)."""
    if not seconds:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    ms = np.asarray(seconds) * 1e3
    return {"n": len(ms), "p50": round(float(np.percentile(ms, 50)), 2), "p99": round(float(np.percentile(ms, 99)), 2),
            "max": round(float(ms.max()), 2)}  # fmt: skip
