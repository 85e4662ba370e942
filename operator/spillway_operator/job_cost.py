"""What a job has cost: the seconds a pod held its node, and status.cost from the settled
attempts and the live one.

Where this sits: read by `attempts` and `reconciler`; pure, the caller passes `now`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from spillway_operator.builders import parse_time, rfc3339


def pod_run_seconds(pod: dict[str, Any], now: datetime) -> float:
    """Seconds the pod has held its node: from startTime to termination (or now)."""
    status = pod.get("status") or {}
    start = parse_time(status.get("startTime"))
    if start is None:
        return 0.0
    end: datetime | None = None
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term and term.get("finishedAt"):
            t = parse_time(term["finishedAt"])
            end = t if end is None or (t and t > end) else end
    if end is None:
        end = now
    return max(0.0, (end - start).total_seconds())


def cost_status(
    now: datetime, settled_usd: float, settled_gpu_hours: float, live_seconds: float, price_per_hour: float, gpus: int
) -> dict[str, Any]:
    """status.cost: settled attempts plus the live one, as of `now`."""
    usd = settled_usd + live_seconds / 3600 * price_per_hour
    gpu_hours = settled_gpu_hours + live_seconds / 3600 * max(gpus, 0)
    return {
        "asOf": rfc3339(now),
        "usd": round(usd, 6),
        "gpuHours": round(gpu_hours, 6),
        "settledUSD": round(settled_usd, 6),
        "settledGpuHours": round(settled_gpu_hours, 6),
        "pricePerHourUSD": price_per_hour,
        "display": f"${usd:,.2f}",
    }
