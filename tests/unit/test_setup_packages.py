"""`make demo` installs what a local run needs and nothing of the test suite's: the system
packages hack/setup.sh would install for it, and the commands `make demo` runs."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUITE_ONLY = {"postgresql", "chromium", "containerd", "runc", "containernetworking-plugins", "buildah", "mmdebstrap"}


def packages(*flags: str) -> list[str]:
    out = subprocess.run(["hack/setup.sh", "--packages", *flags], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_the_demo_needs_libaio_only_and_the_suite_its_servers_and_node_tools() -> None:
    assert packages("--demo") == ["libaio-dev"]
    assert SUITE_ONLY | {"libaio-dev"} <= set(packages())


def test_make_demo_sets_up_for_the_demo_only() -> None:
    commands = subprocess.run(["make", "-n", "demo"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    setups = [line for line in commands.splitlines() if "hack/setup.sh" in line]
    assert setups == ["hack/setup.sh --demo"], commands
