"""`spillway jobs ...`: the REST API from a terminal, through `spillway_api.client`, for users
without kubectl (or a cluster) as much as with.

The API's address is `--api` or SPILLWAY_API_URL (default a local `spillway api`); the token
is `--token` or SPILLWAY_TOKEN, else a local API's own token file when there is one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
import yaml
from rich.console import Console
from rich.table import Table

from spillway_api.client import Client, SpillwayError
from spillway_runtime.core.contract import ExitCode

jobs_app = typer.Typer(name="jobs", help="Jobs of a Spillway API (local or a cluster's): list, submit, stop, cost.",
                       no_args_is_help=True)
err_console = Console(stderr=True, soft_wrap=True)

Api = Annotated[str, typer.Option("--api", envvar="SPILLWAY_API_URL", help="The API's URL")]
Token = Annotated[str | None, typer.Option("--token", envvar="SPILLWAY_TOKEN", show_default=False,
                                           help="Bearer token (a cluster's: kubectl create token NAME "
                                           "--audience spillway); default: a local API's token file")]
Namespace = Annotated[str, typer.Option("--namespace", "-n", help="The job's namespace")]
Output = Annotated[str, typer.Option("--output", "-o", help="table or json")]
LOCAL_API = "http://127.0.0.1:8080"


def _client(url: str, token: str | None) -> Client:
    if token is None:
        from spillway_api.settings import Settings

        token_file = Settings().resolved_token_file
        token = token_file.read_text().strip() if token_file.is_file() else None
    return Client(url, token)


def _run(url: str, token: str | None, call: Any) -> Any:
    try:
        with _client(url, token) as api:
            return call(api)
    except SpillwayError as err:
        err_console.print(f"[red]{err}[/red]" + "".join(f"\n  {e}" for e in err.errors), highlight=False)
        raise typer.Exit(ExitCode.BAD_INPUT if 400 <= err.status < 500 else ExitCode.FAILED) from None
    except httpx.TransportError as err:  # refused, unresolvable, TLS, timed out
        err_console.print(f"[red]cannot reach the API at {url}: {err}[/red] (--api, SPILLWAY_API_URL)")
        raise typer.Exit(ExitCode.FAILED) from None


def _show(records: list[dict[str, Any]], columns: list[str], output: str) -> None:
    if output == "json":
        print(json.dumps(records, indent=1, default=str))
        return
    table = Table(*[c.upper() for c in columns], box=None, pad_edge=False)
    for record in records:
        table.add_row(*[str(record.get(c) if record.get(c) is not None else "") for c in columns])
    Console(soft_wrap=True).print(table)


def _row(job: Any) -> dict[str, Any]:
    progress = job.progress or {}
    return {"namespace": job.namespace, "name": job.name, "phase": job.phase,
            "plan": job.plan.label if job.plan else None,
            "step": f"{progress.get('step')}/{progress.get('totalSteps')}" if progress.get("step") is not None else None,
            "loss": f"{progress['loss']:.4g}" if isinstance(progress.get("loss"), float) else None,
            "message": job.message}


COLUMNS = ["namespace", "name", "phase", "plan", "step", "loss"]


@jobs_app.command("list")
def list_jobs(api: Api = LOCAL_API, token: Token = None,
              namespace: Annotated[str | None, typer.Option("--namespace", "-n", help="Only this namespace")] = None,
              phase: Annotated[str | None, typer.Option(help="Only jobs in this phase")] = None,
              output: Output = "table") -> None:
    """Jobs, every page."""
    jobs = _run(api, token, lambda c: list(c.jobs(namespace, phase)))
    _show([_row(j) for j in jobs], COLUMNS, output)


@jobs_app.command()
def get(name: str, api: Api = LOCAL_API, token: Token = None, namespace: Namespace = "default",
        output: Output = "table") -> None:
    """One job."""
    job = _run(api, token, lambda c: c.get(namespace, name))
    _show([job.model_dump(mode="json", by_alias=True)] if output == "json" else [_row(job)],
          [*COLUMNS, "message"], output)


@jobs_app.command()
def submit(file: Annotated[Path, typer.Option("--file", "-f", help="A FineTuneJob (finetune.yaml)")],
           api: Api = LOCAL_API, token: Token = None, namespace: Namespace = "default") -> None:
    """Submit a FineTuneJob file (as `kubectl apply -f` would in a cluster)."""
    try:
        doc = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError) as err:
        err_console.print(f"[red]--file {file}: {err}[/red]")
        raise typer.Exit(ExitCode.BAD_INPUT) from None
    job = _run(api, token, lambda c: c.submit(namespace, doc))
    print(f"{job.namespace}/{job.name} submitted: {job.phase}")


@jobs_app.command()
def suspend(name: str, api: Api = LOCAL_API, token: Token = None, namespace: Namespace = "default") -> None:
    """Checkpoint and stop a job (resume continues it)."""
    print(f"{namespace}/{name}: {_run(api, token, lambda c: c.suspend(namespace, name)).phase}")


@jobs_app.command()
def resume(name: str, api: Api = LOCAL_API, token: Token = None, namespace: Namespace = "default") -> None:
    """Continue a suspended job from its checkpoint."""
    print(f"{namespace}/{name}: {_run(api, token, lambda c: c.resume(namespace, name)).phase}")


@jobs_app.command()
def rollback(name: str, checkpoint: Annotated[str, typer.Option(help="A checkpoint name (see `checkpoints`)")],
             reason: Annotated[str, typer.Option(help="Why: kept in the job's history")],
             api: Api = LOCAL_API, token: Token = None, namespace: Namespace = "default") -> None:
    """Restart a job from one of its checkpoints."""
    answer = _run(api, token, lambda c: c.rollback(namespace, name, checkpoint, reason))
    print(json.dumps(answer.model_dump(mode="json", by_alias=True), default=str))


@jobs_app.command()
def checkpoints(name: str, api: Api = LOCAL_API, token: Token = None, namespace: Namespace = "default",
                output: Output = "table") -> None:
    """A job's good checkpoints."""
    found = _run(api, token, lambda c: c.checkpoints(namespace, name))
    _show([c.model_dump(mode="json", by_alias=True) for c in found.data], ["name", "step", "loss"], output)


@jobs_app.command()
def cost(name: Annotated[str | None, typer.Argument(help="A job; none: the namespace")] = None,
         api: Api = LOCAL_API, token: Token = None, namespace: Namespace = "default") -> None:
    """What a job, or a namespace, has cost."""
    answer = _run(api, token, lambda c: c.cost(namespace, name))
    print(json.dumps(answer.model_dump(mode="json", by_alias=True), default=str))


@jobs_app.command()
def delete(name: str, api: Api = LOCAL_API, token: Token = None, namespace: Namespace = "default") -> None:
    """Delete a job (its record stays, phase Deleted, in a cluster)."""
    _run(api, token, lambda c: c.delete(namespace, name))
    print(f"{namespace}/{name} deleted")
