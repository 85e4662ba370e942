"""Pod entrypoint: `python -m spillway_runtime --config runtime.json`."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

from spillway_runtime.core.contract import VERBOSE_ENV, ExitCode
from spillway_runtime.training import startup

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    # A stop request that arrives while the imports and set-up run (seconds to minutes) is
    # kept, not fatal: the run then stops at its first step boundary, exit 75.
    early: list[int] = []

    def remember(signum: int, _frame: Any) -> None:
        early.append(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, remember)
    # transformers' and the Hub's tqdm bars ("Writing model shards") would cut through the
    # run's own progress bar and fill pod logs; the events say what they would (`--verbose`
    # shows them).
    if os.environ.get(VERBOSE_ENV) != "1":
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    startup.import_deepspeed()

    from spillway_runtime.checkpoints.store import CheckpointError
    from spillway_runtime.training.dataset_files import DatasetError
    from spillway_runtime.training.k8s_status import in_pod
    from spillway_runtime.training.recipe import FineTuneRecipe
    from spillway_runtime.training.run import RunFailed
    from spillway_runtime.training.runconfig import RuntimeConfig, check_cached_inputs, nvme_problem

    parser = argparse.ArgumentParser(prog="python -m spillway_runtime")
    parser.add_argument("--config", required=True, type=Path, help="RuntimeConfig JSON written by the launcher")
    args = parser.parse_args(argv)
    config = RuntimeConfig.read(args.config)
    if in_pod():
        try:  # the fetch pods filled the node's cache; one emptied since fails here, by field
            check_cached_inputs(config)
        except ValueError as err:
            print(f"spillway: {err}", file=sys.stderr)
            return ExitCode.BAD_INPUT
        if problem := nvme_problem(config):
            print(f"spillway: {problem}", file=sys.stderr)
            return ExitCode.BAD_INPUT
    recipe = FineTuneRecipe(config)  # installs its own stop handler
    recipe.stop_requested = recipe.stop_requested or bool(early)
    code: int = ExitCode.FAILED
    try:
        recipe.setup()
        code = recipe.train()
    except RunFailed as err:
        recipe.reporter.event("failed", reason=str(err), exit_code=err.exit_code)
        print(f"spillway: {err}", file=sys.stderr)
        code = err.exit_code
    except (DatasetError, CheckpointError) as err:
        recipe.reporter.event("failed", reason=str(err), exit_code=ExitCode.BAD_INPUT)
        print(f"spillway: {err}", file=sys.stderr)
        code = ExitCode.BAD_INPUT
    finally:
        recipe.cleanup()
        # The outcome is decided: a signal during interpreter shutdown (when Python has put
        # back the default action, death) must not turn exit 75 into "killed by SIGTERM".
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(main())
