"""The runtime's commands for the `spillway` CLI: probe, plan, make-tiny, export (`spillway run` is the
API package's: it records the job for `spillway api`).

`spillway_api.cli` assembles the full command from this and the other packages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.console import Console
from rich.table import Table

from spillway_runtime.core.contract import ExitCode
from spillway_runtime.core.hardware import NodeHardware
from spillway_runtime.core.largest import LargestFit, largest_model
from spillway_runtime.core.planner import ModelShape, OffloadPlan, PlanInputs, plan_placement
from spillway_runtime.core.spec import FineTuneJob, Method, SpecError, Training, load_job
from spillway_runtime.core.units import format_bytes, format_count, parse_count, parse_size

err_console = Console(stderr=True, soft_wrap=True)


def _fail(message: str, code: int = ExitCode.BAD_INPUT) -> typer.Exit:
    err_console.print(f"[red]error:[/red] {message}", highlight=False)
    return typer.Exit(code)


def probe(
    nvme_path: Annotated[Path | None, typer.Option(help="Directory on the NVMe drive to measure")] = None,
    output: Annotated[Literal["json", "table"], typer.Option(help="json or table")] = "table",
    quick: Annotated[bool, typer.Option(help="Capacities only, skip the speed measurements")] = False,
    aio_seconds: Annotated[float, typer.Option(help="Budget for the async I/O sweep")] = 30.0,
    annotate_node: Annotated[bool, typer.Option(help="Write the figures onto this Kubernetes node")] = False,
    nvme_host_path: Annotated[
        Path | None,
        typer.Option(
            help="Where --nvme-path is on the node itself, when the probe runs in a container "
            "(the hostPath it is mounted from): the path the operator mounts into training pods"
        ),
    ] = None,
) -> None:
    """Measure this machine: GPUs, RAM, cores, NVMe capacity and speed, CPU optimizer speed."""
    from spillway_runtime.probe import ProbeError
    from spillway_runtime.probe import probe as run_probe

    if nvme_host_path is not None and nvme_path is None:
        raise _fail("--nvme-host-path names where --nvme-path is on the node; give --nvme-path too")
    # `--output json > hw.json` must hold the JSON only
    with _stdout_to_stderr() if output == "json" else contextlib.nullcontext():
        try:
            hw = run_probe(nvme_path, quick=quick, aio_budget_seconds=aio_seconds)
        except ProbeError as err:
            raise _fail(str(err)) from None
    if nvme_path is not None and not annotate_node:
        _keep_for_runs(nvme_path, hw)
    if nvme_host_path is not None:
        # The container's mount point means nothing on the node: report the node's path.
        hw = hw.model_copy(update={"nvme_path": str(nvme_host_path)})
    if annotate_node:
        from spillway_runtime.node_probe import NodeProbeError
        from spillway_runtime.node_probe import annotate_node as write_annotations

        try:
            written = write_annotations(hw)
        except NodeProbeError as err:
            raise _fail(str(err)) from None
        Console().print(f"annotated node with {len(written)} spillway.dev/* figures")
    if output == "json":
        print(hw.model_dump_json(indent=2))
        return
    table = Table(title="Node hardware", show_header=False)
    rows = {
        "GPUs": f"{hw.gpu_count} x {hw.gpu_product} ({format_bytes(hw.gpu_memory_bytes)})" if hw.gpu_count else "none",
        "CPU cores": str(hw.cpu_cores),
        "CPU RAM": f"{format_bytes(hw.cpu_memory_bytes)} ({format_bytes(hw.cpu_memory_available_bytes or 0)} available)",
        "NVMe": f"{hw.nvme_path}: {format_bytes(hw.nvme_free_bytes)} free of {format_bytes(hw.nvme_capacity_bytes)}"
        if hw.nvme_path else "not given (--nvme-path)",
    }
    if hw.nvme_read_bytes_per_s and hw.nvme_write_bytes_per_s and hw.aio:
        rows["NVMe speed"] = (
            f"read {hw.nvme_read_bytes_per_s / 1e9:.2f} GB/s, write {hw.nvme_write_bytes_per_s / 1e9:.2f} GB/s"
            + ("" if hw.nvme_transfer_seconds is None else f", {hw.nvme_transfer_seconds * 1e3:.1f} ms a transfer")
            + f" (block {hw.aio.block_size >> 20} MiB, depth {hw.aio.queue_depth}, parallel {hw.aio.intra_op_parallelism})"
        )
    if hw.cpu_adam_params_per_s or hw.torch_adamw_params_per_s:
        rows["CPU Adam"] = (
            f"DeepSpeedCPUAdam {(hw.cpu_adam_params_per_s or 0) / 1e9:.2f} G params/s, "
            f"torch fused AdamW {(hw.torch_adamw_params_per_s or 0) / 1e9:.2f} G params/s"
        )
    if hw.host_device_bytes_per_s:
        rows["Host->GPU"] = f"{hw.host_device_bytes_per_s / 1e9:.1f} GB/s"
    if hw.host_work_scale:
        rows["DeepSpeed host work"] = f"{hw.host_work_scale:.2f}x the step-time model's constants"
    for k, v in rows.items():
        table.add_row(k, v)
    Console().print(table)


def _stdout_to_stderr() -> contextlib.AbstractContextManager[Any]:
    """Everything printed to stdout goes to stderr: DeepSpeed's logger (a StreamHandler bound to
    sys.stdout when DeepSpeed is first imported, here or before) and any library's print."""
    import logging

    if "deepspeed" in sys.modules:
        from deepspeed.utils import logger

        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
                handler.setStream(sys.stderr)
    return contextlib.redirect_stdout(sys.stderr)


def _keep_for_runs(nvme_path: Path, hw: NodeHardware) -> None:
    """`spillway run` on this disk reuses this sweep (longer than the one a run pays on a miss).
    The node-probe DaemonSet's figures go onto the Node instead, so it skips this."""
    from spillway_runtime.probe_cache import store_probe

    try:
        stored = store_probe(nvme_path, hw)
    except OSError as err:
        err_console.print(f"the probe was not cached for `spillway run` ({err})", highlight=False)
        return
    if stored is not None:
        err_console.print(f"cached for `spillway run` in {stored}", highlight=False)


def _print_plan(plan: OffloadPlan) -> None:
    console = Console()
    status = "[green]fits[/green]" if plan.feasible else "[red]does not fit[/red]"
    console.print(f"[bold]{plan.label}[/bold] on {plan.node}: {status}")
    table = Table("tier", "planned", "capacity", "headroom")
    for tier in ("gpu", "cpu", "nvme"):
        planned = getattr(plan.bytes, tier)
        extra = ""
        if tier == "cpu":
            extra = f" (pinned {format_bytes(plan.bytes.cpu_pinned)})"
        table.add_row(
            tier.upper(), format_bytes(planned) + extra, format_bytes(getattr(plan.capacity, tier)),
            format_bytes(getattr(plan.headroom, tier)),
        )
    console.print(table)
    console.print(
        f"activations {format_bytes(plan.activation_bytes)} per process, checkpointing "
        f"{'on' if plan.activation_checkpointing else 'off'}; sub-group {plan.swap.sub_group_size:,}; "
        f"predicted {plan.predicted_step_seconds:.3g} s/step, "
        f"{plan.predicted_total_seconds / 3600:.2f} h for the run"
        + (f", ${plan.predicted_cost_usd:,.2f}" if plan.predicted_cost_usd is not None else "")
    )
    for reason in plan.reasons:
        console.print(f"  - {reason}", highlight=False)
    for s in plan.shortfalls:
        console.print(f"  [red]short:[/red] {s.describe()}", highlight=False)
    for r in plan.rejected:
        console.print(f"  [dim]rejected {r.placement}: {r.why}[/dim]", highlight=False)


def _read_config_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except OSError as err:
        raise _fail(f"{path}: cannot read the file: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise _fail(f"{path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise _fail(f"{path}: expected a JSON object (a Hugging Face config.json)")
    return raw


def plan(
    job_file: Annotated[Path | None, typer.Argument(help="finetune.yaml")] = None,
    params: Annotated[str | None, typer.Option(help="Parameter count: 13B, 13e9, 350M")] = None,
    config: Annotated[Path | None, typer.Option(
        help="The model's config.json: its shape counted by arithmetic, as the operator does")] = None,
    gpus_per_node: Annotated[int | None, typer.Option(help="GPUs per node")] = None,
    gpu_memory: Annotated[str | None, typer.Option(help="Memory of one GPU: 24GiB")] = None,
    cpu_memory: Annotated[str | None, typer.Option(help="CPU RAM: 64GiB")] = None,
    nvme: Annotated[str | None, typer.Option(help="Free NVMe space: 2TB, 0 for none")] = None,
    hardware: Annotated[Path | None, typer.Option(help="NodeHardware JSON from `spillway probe --output json`")] = None,
    nodes: Annotated[int, typer.Option(help="Nodes")] = 1,
    price_per_hour: Annotated[float | None, typer.Option(help="Node price in USD/hour for the cost figure")] = None,
    output: Annotated[Literal["table", "json"], typer.Option(help="table or json")] = "table",
    max_params: Annotated[bool, typer.Option(
        "--max-params", help="Instead: the largest model each placement fits here (settings from the job file)")] = False,
    method: Annotated[Literal["full", "lora"] | None, typer.Option(
        help="full or lora (rank 16 on every linear layer unless the job file says otherwise)")] = None,
    lora_rank: Annotated[int | None, typer.Option(help="LoRA rank (implies --method lora)")] = None,
    memlock: Annotated[str | None, typer.Option(
        help="What a training process may lock (RLIMIT_MEMLOCK, `ulimit -l`): 8MiB (a container's under systemd's "
             "default), or unlimited; DeepSpeed locks its NVMe swap buffers. Default: this process's, when probed "
             "here; else unlimited")] = None,
) -> None:
    """Decide where training state lives; exit 3 when nothing fits, naming the short tier.
    With --max-params: the largest model that fits, per placement."""
    try:
        job: FineTuneJob | None = load_job(job_file) if job_file else None
        if hardware:
            hw = NodeHardware.model_validate_json(hardware.read_text())
        elif gpu_memory or cpu_memory or gpus_per_node is not None or nvme is not None:
            hw = NodeHardware(
                name="given",
                gpu_count=gpus_per_node if gpus_per_node is not None else (1 if gpu_memory else 0),
                gpu_memory_bytes=parse_size(gpu_memory or 0),
                cpu_cores=16,
                cpu_memory_bytes=parse_size(cpu_memory or "64GiB"),
                nvme_capacity_bytes=parse_size(nvme or 0),
                nvme_free_bytes=parse_size(nvme or 0),
            )
        else:
            from spillway_runtime.probe import probe_basic
            from spillway_runtime.probe_cache import hardware_for_run
            from spillway_runtime.training.runconfig import resolve_uri

            if job is not None and job_file is not None and job.spec.offload.nvme.path:
                # as `spillway run` would plan: with the disk's cached sweep, but never sweeping for a dry run
                nvme_dir = resolve_uri(job.spec.offload.nvme.path, job_file.resolve().parent)
                hw, _ = hardware_for_run(nvme_dir, measure=False)
            else:
                hw = probe_basic()
        if memlock is not None:
            hw = hw.model_copy(update={"memlock_bytes": None if memlock == "unlimited" else parse_size(memlock)})
        if max_params:
            spec = job.spec if job else None
            fits = largest_model(hw, spec.training if spec else Training(), spec.offload if spec else None,
                                 dtype=spec.model.dtype if spec else "bf16", gpus_per_node=gpus_per_node,
                                 nodes=nodes)
            _print_largest(hw, fits, output)
            return
        if params:
            shape = ModelShape.from_param_count(parse_count(params))
        elif config is not None:
            shape = ModelShape.from_hf_config(_read_config_json(config))
        elif job is not None and job.spec.model.config is not None:
            shape = ModelShape.from_hf_config(job.spec.model.config)
        elif job is not None and job_file is not None:
            from spillway_runtime.meta_shape import model_shape
            from spillway_runtime.training.runconfig import resolve_uri

            shape = model_shape(resolve_uri(job.spec.model.uri, job_file.resolve().parent))
        else:
            raise _fail("give a job file with a local model directory, or --params N")
        spec = job.spec if job else None
        chosen = spec.method if spec else Method()
        if method is not None or lora_rank is not None:
            chosen = chosen.model_copy(update={"type": method or "lora",
                                               **({"rank": lora_rank} if lora_rank is not None else {})})
        # A job's settings with this command's nodes (one process per CPU node, as before)
        inputs = PlanInputs(shape, method=chosen, gpus_per_node=gpus_per_node, nodes=nodes,
                            price_per_hour=price_per_hour)
        if spec is not None:
            inputs = dataclasses.replace(inputs, training=spec.training, offload=spec.offload, dtype=spec.model.dtype)
        result = plan_placement(inputs, hw)
    except SpecError as err:
        raise _fail(str(err)) from None
    except ValueError as err:
        raise _fail(str(err)) from None
    if output == "json":
        print(json.dumps(result.model_dump(mode="json"), indent=2))
    else:
        _print_plan(result)
    if not result.feasible:
        shorts = "; ".join(s.describe() for s in result.shortfalls)
        err_console.print(
            f"[red]error:[/red] {format_count(shape.params)} parameters do not fit on {hw.name}: {shorts}",
            highlight=False,
        )
        raise typer.Exit(ExitCode.PLAN_INFEASIBLE)


def _print_largest(hw: NodeHardware, fits: list[LargestFit], output: str) -> None:
    if output == "json":
        print(json.dumps([f.model_dump(mode="json") for f in fits], indent=2))
    else:
        table = Table("placement", "largest model", "predicted s/step", "bound by",
                      title=f"The largest model on {hw.name}")
        for f in fits:
            size = format_count(f.parameters) if f.parameters else (f"- ({f.why_not})" if f.why_not else "none")
            step = f"{f.predicted_step_seconds:.3g}" if f.predicted_step_seconds is not None else "-"
            table.add_row(f.placement, size, step, f.bound_by or "")
        Console().print(table)
    best = max(fits, key=lambda f: f.parameters)
    if not best.parameters:
        err_console.print(f"[red]error:[/red] no placement fits even a 1M-parameter model on {hw.name}", highlight=False)
        raise typer.Exit(ExitCode.PLAN_INFEASIBLE)
    if output != "json":
        Console().print(f"largest: {format_count(best.parameters)} parameters with {best.placement}")


def make_tiny(
    out_dir: Annotated[Path, typer.Argument(help="Directory for the model and tokenizer")],
    dataset: Annotated[Path | None, typer.Option(help="Also write a synthetic JSONL dataset here")] = None,
    chat_dataset: Annotated[Path | None, typer.Option(help="Also write the same data as chat records here")] = None,
    hidden_size: int = 128,
    layers: int = 4,
) -> None:
    """Build a tiny Llama model, tokenizer and dataset locally (nothing is downloaded)."""
    from spillway_runtime.tiny import build_tiny_model, write_chat_dataset, write_dataset

    if (out_dir / "config.json").exists():
        Console().print(f"{out_dir} already holds a model; kept")
    else:
        build_tiny_model(out_dir, hidden_size=hidden_size, layers=layers)
        Console().print(f"tiny model written to {out_dir}")
    if dataset is not None and not dataset.exists():
        write_dataset(dataset)
        Console().print(f"dataset written to {dataset}")
    if chat_dataset is not None and not chat_dataset.exists():
        write_chat_dataset(chat_dataset)
        Console().print(f"chat dataset written to {chat_dataset}")


def export(
    checkpoint: Annotated[str, typer.Argument(
        help="A checkpoint's folder (checkpoints/step-...), or a run's checkpoints folder or run folder: its newest "
        "checkpoint; or a mirror, s3://BUCKET/PREFIX (its newest complete checkpoint) or s3://BUCKET/PREFIX/step-...")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for the model (safetensors) and tokenizer")],
    model: Annotated[Path | None, typer.Option(help="The base model the job trained (default: its model.uri)")] = None,
    endpoint_url: Annotated[str | None, typer.Option(
        help="s3://: the S3 endpoint of a non-AWS server (default: AWS_ENDPOINT_URL, else AWS)")] = None,
    universal: Annotated[bool, typer.Option(
        "--universal", help="Write DeepSpeed's universal checkpoint (fp32 masters and Adam moments per parameter, "
        "for any number of processes and ZeRO stage) into --out, a new folder, instead of the model")] = False,
) -> None:
    """Export any checkpoint's model as a Hugging Face directory, without a GPU or a training run."""
    from spillway_runtime.export import ExportError, export_checkpoint, export_from_mirror, export_universal

    try:
        if checkpoint.startswith("s3://"):
            written = export_from_mirror(checkpoint, out, model, endpoint_url, universal)
        elif universal:
            written = export_universal(Path(checkpoint), out)
        else:
            written = export_checkpoint(Path(checkpoint), out, model)
    except ExportError as err:
        raise _fail(str(err)) from None
    Console().print(f"{written['checkpoint']} (step {written['step']}): {written['parameters']} parameters, "
                    f"{format_bytes(written['bytes'])} written to {out}", highlight=False)


def register(app: typer.Typer) -> None:
    app.command()(probe)
    app.command()(plan)
    app.command("make-tiny")(make_tiny)
    app.command()(export)


def main() -> None:  # `python -m spillway_runtime.cli` without the other packages
    app = typer.Typer(no_args_is_help=True, add_completion=False)
    register(app)
    app()


if __name__ == "__main__":
    main()
