"""The operator's commands for the `spillway` CLI: `operator` (run kopf) and `crds`.

`spillway_api.cli` assembles the full command; wire it with
`spillway_operator.cli.register(app)`. Also runnable alone:
`python -m spillway_operator.cli operator --all-namespaces`.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from spillway_operator.crd import CRD_FILE, render_crd_yaml

if TYPE_CHECKING:
    from spillway_operator.settings import OperatorSettings


def crds(
    output_dir: Annotated[
        Path | None,
        typer.Option("--output-dir", "-o", help="Write <dir>/" + CRD_FILE + " instead of printing"),
    ] = None,
    reference: Annotated[
        Path | None,
        typer.Option("--reference", help="Also write the FineTuneJob reference (Markdown: every field) to this file"),
    ] = None,
) -> None:
    """Print (or write) the FineTuneJob CRD generated from the spec models."""
    text = render_crd_yaml()
    if reference is not None:
        from spillway_operator.reference import render_reference_markdown

        reference.write_text(render_reference_markdown())
        typer.echo(f"wrote {reference}", err=output_dir is None)
    if output_dir is None:
        sys.stdout.write(text)
        return
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / CRD_FILE).write_text(text)
    typer.echo(f"wrote {output_dir / CRD_FILE}")


def operator(
    namespace: Annotated[
        list[str] | None,
        typer.Option("--namespace", "-n", help="Watch only these namespaces (repeatable; globs)"),
    ] = None,
    all_namespaces: Annotated[bool, typer.Option("--all-namespaces", "-A", help="Watch the whole cluster")] = False,
    liveness_port: Annotated[int | None, typer.Option(help="kopf /healthz port (0: off)")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Prometheus /metrics port (0: off)")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
    leader_elect: Annotated[
        bool | None,
        typer.Option("--leader-elect/--no-leader-elect",
                     help="Reconcile only while holding a Lease, so several replicas never both act"),
    ] = None,
) -> None:
    """Run the FineTuneJob operator (kopf) until interrupted."""
    import logging
    import os

    if metrics_port is not None:
        os.environ["SPILLWAY_OPERATOR_METRICS_PORT"] = str(metrics_port)
    if liveness_port is not None:
        os.environ["SPILLWAY_OPERATOR_LIVENESS_PORT"] = str(liveness_port)
    if not namespace and not all_namespaces:
        raise typer.BadParameter("pass --namespace NS (repeatable) or --all-namespaces")

    import kopf

    from spillway_operator import handlers
    from spillway_operator.settings import get_settings

    handlers.WATCHED_NAMESPACES = None if all_namespaces else list(namespace or ())
    get_settings.cache_clear()
    settings = get_settings()
    kopf.configure(verbose=verbose, log_format=kopf.LogFormat.PLAIN)
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    liveness = f"http://0.0.0.0:{settings.liveness_port}/healthz" if settings.liveness_port else None
    if settings.webhook_port:
        _serve_webhook(settings)
    run = functools.partial(
        kopf.run,
        standalone=True,  # no kopf peering: exclusivity comes from the Lease below
        clusterwide=all_namespaces,
        namespaces=namespace or (),
        liveness_endpoint=liveness,
    )
    if not (settings.leader_election if leader_elect is None else leader_elect):
        run()
        return

    import threading

    from spillway_operator.leader import LeaderElector, LeaseConfig

    elector = LeaderElector(LeaseConfig(name=settings.lease_name, namespace=settings.namespace))
    typer.echo(f"waiting for lease {settings.namespace}/{settings.lease_name} as {elector.holder}", err=True)
    elector.wait_for_leadership()
    typer.echo(f"leading as {elector.holder}", err=True)
    stop_flag = threading.Event()
    threading.Thread(target=elector.keep_renewing, args=(stop_flag,), daemon=True).start()

    @kopf.on.cleanup()
    def release_lease(**_: object) -> None:
        # At the start of shutdown, not after it: kopf may wait long for worker threads,
        # and a follower should not wait out the lease meanwhile.
        elector.release()

    try:
        run(stop_flag=stop_flag)
    finally:
        elector.release()
    if elector.lost.is_set():
        raise typer.Exit(1)  # restarted by the Deployment, it comes back as a follower


def _serve_webhook(settings: OperatorSettings) -> None:
    """Every replica serves the admission webhook, leader or not: started before the lease."""
    from spillway_operator.certs import CertKeeper, KubeTlsStore, service_dns_names
    from spillway_operator.webhook import WebhookServer

    store = KubeTlsStore(settings.namespace, settings.webhook_secret, settings.webhook_configuration)
    keeper = CertKeeper(store, service_dns_names(settings.webhook_service, settings.namespace),
                        settings.webhook_cert_days)
    WebhookServer(keeper, settings.webhook_port, check_seconds=settings.webhook_cert_check_seconds).start()


def register(app: typer.Typer) -> None:
    app.command("operator")(operator)
    app.command("crds")(crds)


def main() -> None:
    app = typer.Typer(add_completion=False, no_args_is_help=True)
    register(app)
    app()


if __name__ == "__main__":
    main()
