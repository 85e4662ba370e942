"""POST /v1/plan: the tier planner as a dry run, against given hardware or the cluster's node shapes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from spillway_api.deps import MayPlan
from spillway_api.errors import PROBLEM_RESPONSES, ApiError
from spillway_api.schemas import LargestFitPublic, LargestPublic, PlanPublic, PlanRequest, PlansPublic
from spillway_runtime.core.hardware import NodeHardware, hardware_from_node
from spillway_runtime.core.largest import largest_model
from spillway_runtime.core.planner import ModelShape, PlanInputs, plan_placement
from spillway_runtime.core.spec import FineTuneJobSpec, Offload, Training
from spillway_runtime.core.units import parse_count

router = APIRouter(prefix="/v1", tags=["plan"], responses=PROBLEM_RESPONSES)


def _node_hardware(request: Request, body: PlanRequest) -> list[NodeHardware]:
    if body.hardware is not None:
        return [body.hardware]
    if body.nodes:
        try:
            return [hardware_from_node(n.model_dump()) for n in body.nodes]
        except (ValueError, TypeError) as err:
            raise ApiError(422, "invalid_node", f"a node's allocatable resources cannot be read: {err}",
                           errors=[f"nodes: {err}"]) from None
    # Local mode: the machine `spillway run` would train on, as `spillway probe --quick`
    # sees it, with the data directory's disk for NVMe.
    from spillway_runtime.probe import probe_basic

    return [probe_basic(request.app.state.settings.data_dir)]


def _cluster_plans(kube: Any, body: PlanRequest, params: int, training: Training, offload: Offload | None,
                   dtype: str) -> PlansPublic:
    """The cluster's answer is the operator's own: its node exclusions (Ready, cordons,
    nodeSelector, taints), its grouping into shapes, its pricing ConfigMap and its choice."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    from spillway_operator.placement import choose_placement, shape_summary
    from spillway_operator.settings import OperatorSettings

    settings = OperatorSettings()
    if body.spec is not None:
        spec = body.spec.model_copy(deep=True)
        spec.model.dtype = dtype  # type: ignore[assignment]
        if spec.model.config is None:
            spec.model.parameter_count = params
        if "node_count" in body.model_fields_set:
            spec.resources.nodes = body.node_count
        if "gpus_per_node" in body.model_fields_set:
            spec.resources.gpus_per_node = body.gpus_per_node
    else:
        spec = FineTuneJobSpec.model_validate({
            "model": {"uri": "pvc://plan/model", "parameterCount": params, "dtype": dtype},
            "dataset": {"uri": "pvc://plan/data"},
            "resources": {"nodes": body.node_count, "gpusPerNode": body.gpus_per_node},
        })
    spec.training, spec.offload = training, offload or spec.offload
    if body.method is not None:
        spec.method = body.method
    core = client.CoreV1Api(kube)
    nodes = [kube.sanitize_for_serialization(n) for n in core.list_node().items]
    try:
        pricing = core.read_namespaced_config_map(settings.pricing_configmap, settings.namespace).data or {}
    except ApiException as err:
        if err.status not in (403, 404):
            raise
        pricing = {}  # no ConfigMap (or not ours to read): the operator's default prices
    placement = choose_placement(spec, nodes, dict(pricing), settings)
    winner = placement.chosen
    plans: list[PlanPublic] = []
    for choice in placement.shapes:
        node = sorted(choice.nodes)[0]
        if choice.plan is None:
            plans.append(PlanPublic(node=node, feasible=False, label="-", plan=None,
                                    shortfalls=[choice.why_not or "not planned"]))
            continue
        summary = shape_summary(placement, choice)
        plans.append(PlanPublic(node=node, feasible=summary.feasible, label=summary.label, plan=summary,
                                shortfalls=summary.shortfalls or ([choice.why_not] if choice.why_not and
                                                                  not summary.feasible else [])))
    best = sorted(winner.nodes)[0] if winner is not None else None
    return PlansPublic(data=plans, count=len(plans), best=best, excluded=placement.excluded_nodes)


def _largest(request: Request, body: PlanRequest, training: Training, offload: Offload | None,
             dtype: Any) -> PlansPublic:
    """Per node shape (the hardware or nodes given, the cluster's nodes, or this machine):
    the largest model each placement fits."""
    kube = getattr(request.app.state, "kube", None)
    if kube is not None and body.hardware is None and not body.nodes:
        from kubernetes import client

        machines = []
        for node in client.CoreV1Api(kube).list_node().items:
            try:
                machines.append(hardware_from_node(kube.sanitize_for_serialization(node)))
            except (ValueError, TypeError):
                continue  # a node whose resources cannot be read is not a shape to answer for
    else:
        machines = _node_hardware(request, body)
    answers: list[LargestPublic] = []
    seen: set[str] = set()
    for hw in machines:
        if hw.shape_key() in seen:
            continue
        seen.add(hw.shape_key())
        try:
            fits = largest_model(hw, training, offload, dtype=dtype, gpus_per_node=body.gpus_per_node,
                                 nodes=body.node_count)
        except ValueError as err:  # as a plan on this shape reports it: not a fit, not an error of ours
            answers.append(LargestPublic(node=hw.name, placements=[], why_not=str(err)))
            continue
        answers.append(LargestPublic(node=hw.name, placements=[LargestFitPublic.model_validate(f.model_dump())
                                                               for f in fits]))
    ranked = [(max((p.parameters for p in a.placements), default=0), a.node) for a in answers]
    best = max(ranked)[1] if ranked and max(ranked)[0] > 0 else None
    return PlansPublic(data=[], count=0, best=best, largest=answers)


@router.post("/plan", response_model=PlansPublic)
def plan(_caller: MayPlan, request: Request, body: PlanRequest) -> PlansPublic:
    """Where training state would live on each node shape, the predicted step time and cost,
    and for shapes that do not fit, which tier is short and by how much. Without `hardware`
    or `nodes`: in cluster mode, the operator's own placement over the cluster's nodes (its
    exclusions, pricing and choice: `best`); in local mode, this machine. Without a parameter
    count: the largest model each placement fits on each node shape (`largest`; `best` is the
    shape that fits the largest)."""
    raw = body.parameter_count if body.parameter_count is not None else (
        body.spec.model.parameter_count if body.spec else None)
    config = body.spec.model.config if body.spec else None
    training = body.training or (body.spec.training if body.spec else Training())
    offload = body.offload or (body.spec.offload if body.spec else None)
    dtype = body.dtype or (body.spec.model.dtype if body.spec else "bf16")
    if config is not None:  # the real shape wins over a count, as in the operator (validated with the spec)
        shape = ModelShape.from_hf_config(config)
        params = shape.params
    elif raw is None:
        return _largest(request, body, training, offload, dtype)
    else:
        try:
            params = parse_count(raw)
            if params <= 0:
                raise ValueError("must be positive")
            shape = ModelShape.from_param_count(params)
        except (ValueError, TypeError) as err:
            raise ApiError(422, "invalid_parameter_count", f"parameterCount {raw!r}: {err}",
                           errors=[f"parameterCount: {err}"]) from None
    kube = getattr(request.app.state, "kube", None)
    if kube is not None and body.hardware is None and not body.nodes:
        return _cluster_plans(kube, body, params, training, offload, dtype)
    plans: list[PlanPublic] = []
    seen: set[str] = set()
    best: tuple[float, str] | None = None
    for hw in _node_hardware(request, body):
        key = hw.shape_key()
        if key in seen:  # identical shapes plan identically
            continue
        seen.add(key)
        try:
            inputs = PlanInputs(shape, training or Training(), offload or Offload(),
                                body.method or (body.spec.method if body.spec else None), dtype, body.gpus_per_node,
                                body.node_count, body.price_per_hour)
            result = plan_placement(inputs, hw)
        except ValueError as err:
            plans.append(PlanPublic(node=hw.name, feasible=False, label="-", plan=None, shortfalls=[str(err)]))
            continue
        hourly = None if body.price_per_hour is None else body.price_per_hour * body.node_count
        summary = result.summary(price_per_hour=hourly)
        plans.append(PlanPublic(node=hw.name, feasible=result.feasible, label=result.label, plan=summary,
                                shortfalls=summary.shortfalls))
        if result.feasible and (best is None or result.predicted_step_seconds < best[0]):
            best = (result.predicted_step_seconds, hw.name)
    return PlansPublic(data=plans, count=len(plans), best=best[1] if best else None)
