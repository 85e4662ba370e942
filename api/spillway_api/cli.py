"""The `spillway` command, assembled from the commands each package defines beside its code.

The runtime contributes `probe`, `plan`, `make-tiny` and `export`; this package adds `api`
and `run`, which goes through the API's local launcher so the job is recorded in
the database and shows up in `spillway api` like any other.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from spillway_api.client_cli import jobs_app
from spillway_operator.cli import register as register_operator_commands
from spillway_runtime.cli import register as register_runtime_commands
from spillway_runtime.core.contract import VERBOSE_ENV, ExitCode

err_console = Console(stderr=True, soft_wrap=True)  # a path in an error is never cut across lines


def api(
    host: Annotated[str, typer.Option(help="Address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8080,
    no_auth: Annotated[bool, typer.Option("--no-auth", help="No token; forces --host 127.0.0.1")] = False,
    kubernetes: Annotated[bool, typer.Option(
        "--kubernetes", help="Cluster mode: jobs become FineTuneJobs, callers are checked with TokenReview")] = False,
) -> None:
    """Serve the REST API (jobs, history, rollback, cost, plan dry-run)."""
    import uvicorn

    from spillway_api.main import create_app
    from spillway_api.settings import Settings

    overrides: dict[str, Any] = {}
    if no_auth:
        overrides["auth"] = "none"
        if host != "127.0.0.1":
            err_console.print(f"--no-auth binds to 127.0.0.1 only (not {host})")
        host = "127.0.0.1"
    if kubernetes:
        overrides.setdefault("auth", "kubernetes")
        overrides["launcher"] = "kubernetes"
    settings = Settings(**overrides)
    if settings.auth == "none" and host != "127.0.0.1":
        err_console.print("SPILLWAY_AUTH=none binds to 127.0.0.1 only")
        host = "127.0.0.1"
    if (settings.tls_cert_file is None) != (settings.tls_key_file is None):
        err_console.print("SPILLWAY_TLS_CERT_FILE and SPILLWAY_TLS_KEY_FILE go together: set both or neither")
        raise typer.Exit(ExitCode.BAD_INPUT)
    app = create_app(settings)
    if settings.auth == "token":
        err_console.print(f"bearer token in {settings.resolved_token_file} (mode 0600)", highlight=False)
    cert, key = settings.tls_cert_file, settings.tls_key_file
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                           ssl_certfile=cert, ssl_keyfile=key))
    if cert is not None and key is not None:
        from spillway_api.tls import keep_certificate_current

        keep_certificate_current(server, cert, key, settings.tls_reload_seconds)
    server.run()


def run(
    job_file: Annotated[Path, typer.Argument(help="finetune.yaml")],
    run_dir: Annotated[Path | None, typer.Option(help="Where checkpoints, events and the export go")] = None,
    processes: Annotated[int, typer.Option(help="Training processes (ranks) on a CPU-only machine")] = 1,
    reprobe: Annotated[bool, typer.Option(
        "--reprobe", help="Measure this machine again (the NVMe disk's async I/O, the compute rates and "
        "DeepSpeed's host work) instead of using the cached probe (also SPILLWAY_PROBE_REFRESH=1)")] = False,
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="On a terminal, show every event's full record above the progress bar (as "
        "logs get them) and the Hugging Face Hub's progress bars")] = False,
) -> None:
    """Fine-tune on this machine with the plan's offload; the job is recorded for `spillway api`."""
    from spillway_api.launchers.local import LocalRun, local_job_exists, record_local_job
    from spillway_api.settings import Settings
    from spillway_runtime.cli import _print_plan
    from spillway_runtime.core.planner import PlanningError
    from spillway_runtime.core.spec import SpecError, load_job
    from spillway_runtime.local import prepare_local_run
    from spillway_runtime.training.processes import StopSignals

    try:
        job = load_job(job_file)
    except SpecError as err:
        err_console.print(f"[red]error:[/red] {err}", highlight=False)
        raise typer.Exit(ExitCode.BAD_INPUT) from None
    if verbose:
        os.environ[VERBOSE_ENV] = "1"  # the training processes inherit it
    settings = Settings()
    run_dir = (run_dir or Path.cwd() / "runs" / job.metadata.name).resolve()
    if local_job_exists(settings, job.metadata.namespace, job.metadata.name):
        # A re-run: refused input must not rewrite the earlier run's record (its outcome,
        # spec and history), so it is checked before the record is taken over.
        try:
            prepare_local_run(job_file.resolve(), run_dir=run_dir, processes=processes, job=job, reprobe=reprobe)
            reprobe = False  # measured just now
        except (SpecError, ValueError, OSError) as err:
            if isinstance(err, PlanningError):
                _print_plan(err.plan)
            err_console.print(f"[red]error:[/red] {err}", highlight=False)
            err_console.print(f"the record of the earlier run of {job.metadata.name} is unchanged", highlight=False)
            raise typer.Exit(ExitCode.PLAN_INFEASIBLE if isinstance(err, PlanningError) else ExitCode.BAD_INPUT) from None
    sessions, job_id = record_local_job(settings, job, job_file.resolve(), run_dir)
    local = LocalRun(sessions, job_id, processes=processes, price_per_hour=settings.local_price_per_hour,
                     poll_seconds=settings.local_poll_seconds, foreground=True, origin="rerun", reprobe=reprobe)

    def planned(config: Any) -> None:
        _print_plan(config.plan)
        if config.probe is not None:
            Console().print(config.probe.describe(), highlight=False)
        Console().print(f"run directory: {config.run_dir}")

    local.on_planned = planned
    with StopSignals(local, say=lambda message: err_console.print(message, highlight=False)):
        code = local.run()
    error = getattr(local, "error", None)
    if error is not None:
        if isinstance(error, PlanningError):
            _print_plan(error.plan)
        err_console.print(f"[red]error:[/red] {error}", highlight=False)
        raise typer.Exit(ExitCode.PLAN_INFEASIBLE if isinstance(error, PlanningError) else ExitCode.BAD_INPUT)
    if code == 0 and local.config is not None:
        from spillway_runtime.training.reporting import read_events, where_state_lived
        from spillway_runtime.training.step_times import step_time_line

        config = local.config
        events = read_events(Path(config.events_path))
        lines = where_state_lived(config.plan, events, config.nvme_dir if config.plan.uses_nvme else None)
        for line in [*lines, step_time_line(config.plan.predicted_step_seconds, events)]:
            if line:
                Console().print(line, highlight=False)
        Console().print(f"[green]done[/green]: model exported to {config.export_dir}")
    raise typer.Exit(code)


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="spillway",
        help="Fine-tune models that do not fit in GPU memory: plan, probe and run with offload.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    register_runtime_commands(app)  # probe, plan, make-tiny, export
    app.command()(run)
    app.command()(api)
    app.add_typer(jobs_app)
    register_operator_commands(app)
    return app


def main() -> None:
    build_app()()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
