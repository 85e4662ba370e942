"""/v1/namespaces/{namespace}/cost: the cost ledger summed per job over a period."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BeforeValidator

from spillway_api.deps import CanList, ServiceDep
from spillway_api.errors import PROBLEM_RESPONSES, ApiError
from spillway_api.routes.jobs import Namespace
from spillway_api.schemas import NamespaceCost


def _iso_8601(value: Any) -> Any:
    # pydantic reads a bare number as seconds since 1970: a date-time must look like one.
    if isinstance(value, str) and not re.match(r"\d{4}-\d{2}-\d{2}", value):
        raise ValueError("not an ISO 8601 date-time; give e.g. 2026-01-01T00:00:00Z")
    return value


IsoDatetime = Annotated[datetime, BeforeValidator(_iso_8601)]

router = APIRouter(prefix="/v1/namespaces/{namespace}", tags=["cost"], responses=PROBLEM_RESPONSES)


@router.get("/cost", response_model=NamespaceCost)
def namespace_cost(
    _caller: CanList, namespace: Namespace, service: ServiceDep,
    since: Annotated[IsoDatetime | None, Query(description="ISO 8601; inclusive")] = None,
    until: Annotated[IsoDatetime | None, Query(description="ISO 8601; exclusive")] = None,
) -> NamespaceCost:
    """Spend in the namespace between since and until, per job and in total."""
    if since is not None and until is not None and since.tzinfo is not None and until.tzinfo is not None \
            and since > until:
        raise ApiError(422, "invalid_period", "since is after until; swap them", errors=["since: after until"])
    if (since is not None and since.tzinfo is None) or (until is not None and until.tzinfo is None):
        raise ApiError(422, "naive_time", "give since and until with a time zone, e.g. 2026-01-01T00:00:00Z",
                       errors=["since/until: needs a UTC offset"])
    return NamespaceCost.model_validate(service.namespace_cost(namespace, since, until))
