"""Branch coverage per package, from a combined coverage data file (hack/test.sh --coverage).

    coverage_report.py DATA                 statements, branches and what was covered, per package
    coverage_report.py BEFORE AFTER...      the same for each, and every line and branch that BEFORE
                                            covered and no AFTER did (the product code must be the
                                            same in every run: a test change is what is compared;
                                            more AFTER runs: what else of the suite covers a line)

Files are matched by their path from the package down (spillway_runtime/training/recipe.py), so two
checkouts of the same code compare.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from coverage import Coverage, CoverageData

PACKAGES = ("spillway_runtime", "spillway_operator", "spillway_api")


def package_path(filename: str) -> str | None:
    parts = Path(filename).parts
    for index, part in enumerate(parts):
        if part in PACKAGES:
            return "/".join(parts[index:])
    return None


def per_package(data_file: str) -> dict[str, dict[str, int]]:
    """coverage's JSON report's file summaries, summed by package (unexecuted files of the
    packages count too: coverage finds them from source_pkgs)."""
    cov = Coverage(data_file=data_file)
    cov.load()
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cov.json_report(outfile=out.name)
        files = json.loads(Path(out.name).read_text())["files"]
    totals: dict[str, dict[str, int]] = {p: defaultdict(int) for p in PACKAGES}
    for filename, entry in files.items():
        path = package_path(filename)
        if path is None:
            continue
        summary, total = entry["summary"], totals[path.split("/")[0]]
        total["files"] += 1
        for key in ("num_statements", "covered_lines", "num_branches", "covered_branches"):
            total[key] += summary[key]
    return totals


def print_table(title: str, totals: dict[str, dict[str, int]]) -> None:
    print(f"{title}\n{'package':<20}{'files':>6}{'statements':>12}{'covered':>9}{'lines':>8}"
          f"{'branches':>10}{'covered':>9}{'branch':>8}")
    for package, t in totals.items():
        lines = 100 * t["covered_lines"] / max(t["num_statements"], 1)
        branches = 100 * t["covered_branches"] / max(t["num_branches"], 1)
        print(f"{package:<20}{t['files']:>6}{t['num_statements']:>12}{t['covered_lines']:>9}{lines:>7.1f}%"
              f"{t['num_branches']:>10}{t['covered_branches']:>9}{branches:>7.1f}%")


def measured(data_file: str) -> tuple[dict[str, set[int]], dict[str, set[tuple[int, int]]]]:
    data = CoverageData(basename=data_file)
    data.read()
    lines: dict[str, set[int]] = defaultdict(set)
    arcs: dict[str, set[tuple[int, int]]] = defaultdict(set)
    for filename in data.measured_files():
        path = package_path(filename)
        if path is not None:
            lines[path] |= set(data.lines(filename) or ())
            arcs[path] |= set(data.arcs(filename) or ())
    return lines, arcs


def compare(before: str, *afters: str) -> int:
    """Prints what BEFORE covered and none of AFTERS did; returns how many lines and arcs that is."""
    lines_before, arcs_before = measured(before)
    lines_after: dict[str, set[int]] = defaultdict(set)
    arcs_after: dict[str, set[tuple[int, int]]] = defaultdict(set)
    for after in afters:
        lines, arcs = measured(after)
        for path in lines:
            lines_after[path] |= lines[path]
        for path in arcs:
            arcs_after[path] |= arcs[path]
    lost = 0
    for path in sorted(set(lines_before) | set(arcs_before)):
        lines = sorted(lines_before[path] - lines_after.get(path, set()))
        arcs = sorted(arcs_before[path] - arcs_after.get(path, set()))
        if lines or arcs:
            lost += len(lines) + len(arcs)
            print(f"{path}: lines {lines or '-'}; branches {[f'{a}->{b}' for a, b in arcs] or '-'}")
    gained = sum(len(lines_after[p] - lines_before.get(p, set())) for p in lines_after)
    print(f"covered before, not after: {lost} lines and branches; lines covered after, not before: {gained}")
    return lost


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    for index, data_file in enumerate(argv):
        print_table(data_file if len(argv) == 1 else f"{'before' if index == 0 else 'after'}: {data_file}",
                    per_package(data_file))
    return 0 if len(argv) == 1 else min(compare(*argv), 1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
