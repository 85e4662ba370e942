"""The `spillway` command, assembled from the commands each package defines beside its code."""

from __future__ import annotations

import typer

from spillway_runtime.cli import register as register_runtime


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="spillway",
        help="Fine-tune models that do not fit in GPU memory: plan, probe and run with offload.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    register_runtime(app)
    return app


def main() -> None:
    build_app()()


if __name__ == "__main__":
    main()
