"""Pod entrypoint: `python -m spillway_runtime --config runtime.json`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spillway_runtime.checkpoint import CheckpointError
from spillway_runtime.data import DatasetError
from spillway_runtime.recipe import EXIT_BAD_INPUT, EXIT_FAILED, FineTuneRecipe, RunFailed
from spillway_runtime.runconfig import RuntimeConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spillway_runtime")
    parser.add_argument("--config", required=True, type=Path, help="RuntimeConfig JSON written by the launcher")
    args = parser.parse_args(argv)
    config = RuntimeConfig.read(args.config)
    recipe = FineTuneRecipe(config)
    code = EXIT_FAILED
    try:
        recipe.setup()
        code = recipe.train()
    except RunFailed as err:
        recipe.reporter.event("failed", reason=str(err), exit_code=err.exit_code)
        print(f"spillway: {err}", file=sys.stderr)
        code = err.exit_code
    except (DatasetError, CheckpointError) as err:
        recipe.reporter.event("failed", reason=str(err), exit_code=EXIT_BAD_INPUT)
        print(f"spillway: {err}", file=sys.stderr)
        code = EXIT_BAD_INPUT
    finally:
        recipe.cleanup()
    return code


if __name__ == "__main__":
    sys.exit(main())
