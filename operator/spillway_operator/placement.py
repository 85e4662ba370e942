"""Node choice: which node shape a FineTuneJob runs on, and the plan for it.

Where this sits: a pure part of the operator's builders layer (re-exported by
`builders`): nodes as plain dicts in, a `Placement` out. Every node is read as a
`NodeHardware`, nodes are grouped by shape, the runtime's planner runs once per
shape, and the cheapest or fastest shape that fits wins; the rest are kept with
the reason they lost, for `status.plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spillway_operator.node_pools import PRICE_ANNOTATION, pool_of
from spillway_operator.settings import OperatorSettings
from spillway_runtime.core.hardware import AioSettings, NodeHardware, hardware_from_node
from spillway_runtime.core.param_counts import count_decoder
from spillway_runtime.core.plan_summary import PlanSummary
from spillway_runtime.core.planner import ModelShape, OffloadPlan, PlanInputs, plan_placement
from spillway_runtime.core.spec import FineTuneJobSpec, Toleration
from spillway_runtime.core.units import format_count


def _node_ready(node: dict[str, Any]) -> bool:
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _tolerates(taint: dict[str, Any], tolerations: list[Toleration]) -> bool:
    for t in tolerations:
        if t.effect and t.effect != taint.get("effect"):
            continue
        if t.key is None and t.operator == "Exists":
            return True
        if t.key != taint.get("key"):
            continue
        if t.operator == "Exists" or t.value == taint.get("value"):
            return True
    return False


def node_excluded(node: dict[str, Any], spec: FineTuneJobSpec) -> str | None:
    """Why the scheduler would never place this job's pod on `node` (None: it may)."""
    if not _node_ready(node):
        return "not Ready or cordoned"
    labels = (node.get("metadata") or {}).get("labels") or {}
    for key, value in spec.resources.node_selector.items():
        if labels.get(key) != value:
            return f"nodeSelector {key}={value} does not match"
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(taint, spec.resources.tolerations):
            return f"taint {taint.get('key')}={taint.get('value', '')}:{taint.get('effect')} not tolerated"
    return None


def gpu_hour_price(hw: NodeHardware, pricing: dict[str, str], settings: OperatorSettings) -> tuple[float, str]:
    """USD per GPU-hour (or per node-hour without GPUs) and where the figure came from."""
    if not hw.gpu_count:
        raw = pricing.get("cpu-node")
        return (float(raw), "pricing:cpu-node") if raw else (settings.default_cpu_node_hour_usd, "default")
    product = hw.gpu_product or ""
    for key in (product, product.replace("-", " ")):
        if key in pricing:
            return float(pricing[key]), f"pricing:{key}"
    if "default" in pricing:
        return float(pricing["default"]), "pricing:default"
    return settings.default_gpu_hour_usd, "default"


@dataclass
class ShapeChoice:
    """The plan on one node shape, or why that shape cannot take the job."""

    shape: str
    nodes: list[str]
    hardware: NodeHardware
    price_per_hour: float = 0.0
    plan: OffloadPlan | None = None
    why_not: str | None = None
    pool: str | None = None  # a declared node pool's template nodes (node_pools), not nodes that exist
    pool_price: float | None = None


@dataclass
class Placement:
    chosen: ShapeChoice | None
    shapes: list[ShapeChoice] = field(default_factory=list)
    excluded_nodes: dict[str, str] = field(default_factory=dict)

    @property
    def failure(self) -> str:
        """One sentence for a job that fits nowhere: the short tier and by how much."""
        if not self.shapes:
            if self.excluded_nodes:
                why = "; ".join(f"{n}: {w}" for n, w in sorted(self.excluded_nodes.items())[:5])
                return f"no node is eligible ({why})"
            return "the cluster has no nodes"
        return "no node shape fits: " + "; ".join(f"{s.shape}: {s.why_not}" for s in self.shapes)


# A parameterCount this far from the config's own count is worth a line in status.plan.
PARAMETER_COUNT_TOLERANCE = 0.10


def model_shape(spec: FineTuneJobSpec, read: dict[str, Any] | None = None) -> tuple[ModelShape, list[str]]:
    """The shape to plan with, and lines for status.plan.reasons saying where it came from:
    spec.model.config (the real shape), else config.json as read from the model's volume
    (`read`: status.modelConfig, `{source, config}` or `{source, error}`), else a Llama-shaped
    guess from parameterCount."""
    read = read or {}
    config, count = spec.model.config, spec.model.parameter_count
    origin = "spec.model.config"
    if config is None and "config" in read:
        config, origin = read["config"], f"config.json on {read['source']}"
    if config is None:
        if count is None:
            raise ValueError("give spec.model.config (the model's config.json) or spec.model.parameterCount "
                             "(e.g. 7B) to plan in a cluster")
        why = (f"config.json could not be read from {read['source']} ({read['error']}), so the model shape is"
               if "error" in read else "model shape")
        return ModelShape.from_param_count(count), [
            f"{why} guessed from parameterCount as a Llama-shaped decoder with a 32k vocabulary: "
            "give spec.model.config for the real shape"]
    counts = count_decoder(config)
    experts = f", {counts.experts} experts per MoE layer" if counts.experts else ""
    notes = [f"model shape from {origin} ({counts.model_type}, {counts.vocab_size:,}-token vocabulary, "
             f"{format_count(counts.params)} parameters{experts})"]
    if count is not None and abs(count - counts.params) > PARAMETER_COUNT_TOLERANCE * counts.params:
        notes.append(f"spec.model.parameterCount ({format_count(count)}) differs from the config's "
                     f"{format_count(counts.params)} by {abs(count - counts.params) / counts.params:.0%}: "
                     "planned with the config's")
    return ModelShape.from_hf_config(config), notes


def choose_placement(
    spec: FineTuneJobSpec,
    nodes: list[dict[str, Any]],
    pricing: dict[str, str],
    settings: OperatorSettings,
    read: dict[str, Any] | None = None,
    aio_block_size: int | None = None,
) -> Placement:
    """Plan once per distinct node shape and pick the cheapest or fastest that fits
    (`read`: the model's config.json as read from its volume, see `model_shape`).
    `aio_block_size`: the async-I/O block size the job's checkpoints were written under,
    kept whatever the nodes' probes say now: it decides which small optimizer sub-groups
    DeepSpeed swaps, so a resume under another one finds the checkpoint's files wrong."""
    shape, shape_notes = model_shape(spec, read)
    groups, excluded = _node_shapes(spec, nodes, aio_block_size)
    for choice in groups.values():
        _plan_shape(choice, spec, shape, shape_notes, pricing, settings, aio_block_size)
    fits = [c for c in groups.values() if c.plan is not None and c.plan.feasible]
    chosen: ShapeChoice | None = None
    if fits:
        if spec.resources.placement == "fastest":
            chosen = min(fits, key=lambda c: (_total_seconds(c), _cost(c), c.shape))
        else:
            chosen = min(fits, key=lambda c: (_cost(c), _total_seconds(c), c.shape))
        for c in fits:
            if c is not chosen:
                c.why_not = (
                    f"{spec.resources.placement} placement chose {chosen.shape}: this one costs "
                    f"${_cost(c):.2f} in {_total_seconds(c) / 3600:.2f} h vs ${_cost(chosen):.2f} in "
                    f"{_total_seconds(chosen) / 3600:.2f} h"
                )
    return Placement(chosen=chosen, shapes=sorted(groups.values(), key=lambda c: c.shape), excluded_nodes=excluded)


def _node_shapes(spec: FineTuneJobSpec, nodes: list[dict[str, Any]], aio_block_size: int | None,
                 ) -> tuple[dict[str, ShapeChoice], dict[str, str]]:
    """The nodes the job may use, grouped by hardware shape (a declared pool's template apart),
    and the others with why not."""
    groups: dict[str, ShapeChoice] = {}
    excluded: dict[str, str] = {}
    for node in nodes:
        name = (node.get("metadata") or {}).get("name", "?")
        why = node_excluded(node, spec)
        if why:
            excluded[name] = why
            continue
        hw = _with_block_size(hardware_from_node(node), aio_block_size)
        pool = pool_of(node)
        key = f"{hw.shape_key()} (declared pool {pool})" if pool else hw.shape_key()
        if key in groups:
            groups[key].nodes.append(name)
        else:
            price = ((node.get("metadata") or {}).get("annotations") or {}).get(PRICE_ANNOTATION)
            groups[key] = ShapeChoice(shape=key, nodes=[name], hardware=hw, pool=pool,
                                      pool_price=float(price) if price else None)
    return groups, excluded


def _plan_shape(choice: ShapeChoice, spec: FineTuneJobSpec, shape: ModelShape, shape_notes: list[str],
                pricing: dict[str, str], settings: OperatorSettings, aio_block_size: int | None) -> None:
    """The shape's price and plan, or why the job cannot run there (choice.why_not)."""
    hw = choice.hardware
    gpus = hw.gpu_count if spec.resources.gpus_per_node is None else spec.resources.gpus_per_node
    choice.price_per_hour, _ = gpu_hour_price(hw, pricing, settings)
    if choice.pool_price is not None:
        choice.price_per_hour = choice.pool_price
    # Per node: the planner multiplies by the job's node count itself.
    node_price = choice.price_per_hour * (gpus if hw.gpu_count else 1)
    if gpus > hw.gpu_count:
        choice.why_not = f"resources.gpusPerNode is {gpus} but the shape has {hw.gpu_count} GPUs"
        return
    if len(choice.nodes) < spec.resources.nodes:
        choice.why_not = f"resources.nodes is {spec.resources.nodes} but only {len(choice.nodes)} such nodes"
        return
    try:
        plan = plan_placement(PlanInputs.of_spec(spec, shape, gpus_per_node=gpus, price_per_hour=node_price), hw)
    except ValueError as err:
        choice.why_not = str(err)
        return
    kept = []
    if aio_block_size is not None and plan.uses_nvme:
        kept = [f"async-I/O block size {aio_block_size >> 10} KiB kept from the job's checkpoints"]
    plan.reasons = [*shape_notes, *kept, *plan.reasons]
    choice.plan = plan
    if not plan.feasible:
        shorts = "; ".join(s.describe() for s in plan.shortfalls) or "no allowed placement"
        choice.why_not = f"closest {plan.label}: {shorts}"


def _with_block_size(hw: NodeHardware, block_size: int | None) -> NodeHardware:
    if block_size is None:
        return hw
    aio = (hw.aio or AioSettings()).model_copy(update={"block_size": block_size})
    return hw.model_copy(update={"aio": aio})


def _cost(c: ShapeChoice) -> float:
    assert c.plan is not None
    return c.plan.predicted_cost_usd or 0.0


def _total_seconds(c: ShapeChoice) -> float:
    assert c.plan is not None
    return c.plan.predicted_total_seconds


def plan_status(placement: Placement) -> dict[str, Any] | None:
    """status.plan: the chosen plan's summary (the runtime's `PlanSummary`), with every other
    shape and the reason it lost. Nothing fits: the closest plan, marked infeasible; no
    shape could even be planned: None (the NoFit condition says why for each)."""
    chosen = placement.chosen
    if chosen is None or chosen.plan is None:
        planned = [c for c in placement.shapes if c.plan is not None]
        if not planned:
            return None
        chosen = min(planned, key=lambda c: (_short_bytes(c), c.shape))
    return shape_summary(placement, chosen).dump()


def shape_summary(placement: Placement, choice: ShapeChoice) -> PlanSummary:
    """One shape's plan as the plan summary: priced for all the job's GPUs (or CPU nodes),
    its nodes, and every other shape with the reason it lost."""
    assert choice.plan is not None
    rejected = [{"shape": c.shape, "nodes": len(c.nodes), "why": c.why_not or ""}
                for c in placement.shapes if c is not choice]
    return choice.plan.summary(
        price_per_hour=round(_hourly(choice, choice.plan), 4), shape=choice.shape, node_names=sorted(choice.nodes),
        gpu_product=choice.hardware.gpu_product, rejected_shapes=rejected,
    )


def _short_bytes(c: ShapeChoice) -> int:
    assert c.plan is not None
    return sum(s.short_bytes for s in c.plan.shortfalls)


def _hourly(choice: ShapeChoice, plan: OffloadPlan) -> float:
    units = plan.gpus_per_node if choice.hardware.gpu_count else 1
    return choice.price_per_hour * units * plan.nodes
