"""The GPU kit's report (benchmarks/gpu/kit.py): every stage's results, rewritten to
$OUT/gpu_kit.json and $OUT/gpu_kit.md after each stage, so a call cut short keeps what it
measured. Standard library only: the kit imports it before spillway is installed."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kit import Settings

GiB = 1 << 30


@dataclass
class Report:
    settings: Settings
    hardware: dict[str, Any]
    stages: dict[str, Any] = field(default_factory=dict)

    def add(self, stage: str, result: dict[str, Any]) -> None:
        self.stages[stage] = result
        self.write()

    def write(self) -> None:
        document = {"dry_run": self.settings.dry_run, "budget_seconds": self.settings.budget_seconds,
                    "elapsed_seconds": round(time.monotonic() - self.settings.started, 1),
                    "cap_bytes": self.settings.cap_bytes, "hardware": self.hardware, "stages": self.stages}
        for name, text in (("gpu_kit.json", json.dumps(document, indent=2, default=str)), ("gpu_kit.md", self.markdown())):
            tmp = self.settings.out / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.settings.out / name)  # a call cut short never leaves half a report

    def rows(self) -> list[tuple[str, dict[str, Any]]]:
        a = self.stages.get("a_gpu_resident", {})
        rows = [("a", r) for r in a.get("trials", [])]
        for stage, key in (("b", "b_offloaded"), ("e", "e_overlap")):
            rows += [(stage, r) for r in self.stages.get(key, {}).values() if isinstance(r, dict) and "placement" in r]
        return rows

    def markdown(self) -> str:
        lines = ["| stage | placement | params | step s | tokens/s | peak GPU GiB | peak RSS GiB | swap GiB "
                 "| ratio gpu / cpu / nvme / step | step / planned at 35% of peak |", "|---|---|---|---|---|---|---|---|---|---|"]
        for stage, r in self.rows():
            m = r.get("measured")
            if not m:
                why = r.get("error") or r.get("skipped") or ""
                lines.append(f"| {stage} | {r['placement']} | {r['predicted']['params']:,} | {why[:60]!r} "
                             "| | | | | | |")
                continue
            ratio = r["ratio"]
            gib = [f"{v / GiB:.2f}" if v is not None else "-" for v in
                   (m["peak_gpu_bytes"], m["peak_rss_bytes"], m["swap_bytes"])]
            # the step planned without the GPU's measured decoder layers (`probe.measure_gpu_decoder`)
            at_peak = r["predicted"].get("step_seconds_at_peak_share")
            lines.append(f"| {stage} | {r['placement']} | {r['predicted']['params']:,} | {m['step_seconds']} | "
                         f"{m['tokens_per_second']} | {' | '.join(gib)} | "
                         f"{' / '.join(str(ratio[k]) for k in ('gpu', 'cpu', 'nvme', 'step'))} | "
                         f"{round(m['step_seconds'] / at_peak, 3) if at_peak else '-'} |")
        for key, what in (("d_resume", "SIGKILL and resume"), ("f_twin_flow_resume", "Twin-Flow, SIGKILL and resume")):
            if self.stages.get(key):
                lines += ["", f"{what}: {json.dumps(self.stages[key])}"]
        return "\n".join(lines) + "\n"
