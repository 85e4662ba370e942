"""The dashboard's bundle is committed in the package (built by hack/build-dashboard.sh), referenced
by index.html, and the page loads nothing from another origin."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from spillway_api.routes.dashboard import STATIC_DIR

REPO = Path(__file__).resolve().parents[3]


def test_bundle_is_committed_and_referenced_by_index() -> None:
    index = (STATIC_DIR / "index.html").read_text()
    refs = re.findall(r'(?:src|href)="([^"#]+)"', index)
    assert "assets/app.js" in refs and "assets/app.css" in refs, refs
    for ref in refs:
        if ref == "data:,":  # the empty favicon, so the browser asks for no /favicon.ico
            continue
        assert not re.match(r"^(https?:)?//", ref), f"index.html loads {ref} from another origin"
        assert ref.startswith("assets/"), ref
        path = STATIC_DIR / ref.removeprefix("assets/")
        assert path.is_file() and path.stat().st_size > 0, f"{ref} is missing: run hack/build-dashboard.sh"
    bundle = (STATIC_DIR / "app.js").read_text()
    assert "uPlot" in bundle or "uplot" in bundle, "the charting library is bundled, not fetched"
    assert not re.search(r"""(?:import|from|fetch\()\s*\(?["']https?://""", bundle), "the bundle fetches from the network"


def test_sources_and_lockfile_are_committed() -> None:
    dash = REPO / "dashboard"
    for name in ("package.json", "package-lock.json", "build.mjs", "index.html", "src/main.js"):
        assert (dash / name).is_file(), name
    assert (dash / "index.html").read_text() == (STATIC_DIR / "index.html").read_text(), \
        "static/index.html is stale: run hack/build-dashboard.sh"


def test_the_bundle_was_built_from_the_committed_sources() -> None:
    """dashboard/build.mjs stamps the bundle with a hash of every input it read (its own
    code, index.html, the package files, every file under src/); a source edited without a
    rebuild fails here."""
    dash = REPO / "dashboard"
    inputs = ["build.mjs", "index.html", "package.json", "package-lock.json"]
    inputs += [str(p.relative_to(dash)) for p in (dash / "src").rglob("*") if p.is_file()]
    digest = hashlib.sha256()
    for name in sorted(inputs):
        digest.update(name.encode() + b"\0" + (dash / name).read_bytes() + b"\0")
    stamp = (STATIC_DIR / "SOURCES.sha256").read_text().strip()
    assert stamp == digest.hexdigest(), "api/spillway_api/static/ is stale: run hack/build-dashboard.sh"


def test_the_dashboards_phases_are_the_contracts() -> None:
    from spillway_runtime.core.contract import PHASES

    source = (REPO / "dashboard" / "src" / "jobs.js").read_text()
    listed = re.search(r"export const PHASES = \[([^\]]*)\]", source)
    assert listed is not None
    assert tuple(re.findall(r'"([^"]+)"', listed.group(1))) == PHASES
