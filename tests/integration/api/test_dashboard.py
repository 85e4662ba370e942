"""The web dashboard in a real headless Chromium (Debian's package, driven by Playwright) against
a real `uvicorn` serving the API on a temporary SQLite database, with a tiny job that really
trains on the CPU through the local launcher.

The jobs table shows the job submitted over HTTP (preference tuning, DPO with LoRA); the loss
curve has one point per recorded step, the rewards chart the step's and the held-out pairs'
reward margin and accuracy; the rollback button sets spec.resumeFrom through the API and the page shows the restart;
the plan explorer's numbers are POST /v1/plan's. Screenshots land in artifacts/screenshots/.
A missing Chromium or Playwright fails the test: nothing here is skipped."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from spillway_api.settings import Settings
from tests import polling
from tests.browser import chromium, shot

from ..conftest import job_document
from .conftest import job_body
from .servers import serve

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"

def wait_for(predicate: Any, timeout: float = 120, what: str = "condition") -> Any:
    return polling.wait_for(predicate, timeout, what)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with serve(tmp_path_factory.mktemp("dashboard"), "token") as s:
        yield s


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


def test_dashboard_jobs_detail_rollback_and_plan(server: dict[str, Any], browser: Any,
                                                  tiny_model: dict[str, Path]) -> None:
    api: httpx.Client = server["api"]
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(30_000)
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
            if m.type == "error" and "401" not in m.text else None)
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))

    # -- the token is asked once, kept in sessionStorage and sent on every call -----------------
    page.goto(server["url"] + "/")
    dialog = page.locator("#token-dialog")
    dialog.wait_for(state="visible")
    assert page.evaluate("document.activeElement.id") == "token-input"
    page.fill("#token-input", server["token"])
    page.keyboard.press("Enter")
    dialog.wait_for(state="hidden")
    assert page.evaluate("sessionStorage.getItem('spillway.token')") == server["token"]

    # -- jobs table: a job created through the API appears without reloading -------------------
    # DPO with LoRA on the DPO example's preference pairs (its chat template for the chat records)
    example = yaml.safe_load((EXAMPLES / "dpo-lora-local.yaml").read_text())["spec"]
    doc = job_document("tiny", tiny_model["model"], EXAMPLES / example["dataset"]["uri"],
                       training={"maxSteps": 6, "warmupSteps": 1, "evalEverySteps": 3, "sequenceLength": 64,
                                 "evalBatches": 2},
                       checkpoint={"everySteps": 2, "keep": 5})
    doc["spec"]["dataset"].update(format="preference", chatTemplate=example["dataset"]["chatTemplate"],
                                  validation={"fraction": 0.1})
    # LoRA is said beside the plan on the detail page
    doc["spec"]["method"] = {"type": "lora", "rank": 8, "objective": "dpo", "beta": 0.1}
    r = api.post("/v1/namespaces/local/jobs", json={"metadata": doc["metadata"], "spec": doc["spec"]})
    assert r.status_code == 201, r.text
    r = api.post("/v1/namespaces/team-b/jobs", json=job_body("refused"))  # no such model: fails at planning
    assert r.status_code == 201, r.text
    row = page.locator('tr[data-job="local/tiny"]')
    row.wait_for()
    page.locator('tr[data-job="team-b/refused"][data-phase="Failed"]').wait_for()
    base = "/v1/namespaces/local/jobs/tiny"
    wait_for(lambda: api.get(base).json()["phase"] in ("Succeeded", "Failed") and api.get(base).json()["exitCode"]
             is not None, 180, "the tiny job to finish")
    job = api.get(base).json()
    assert job["phase"] == "Succeeded", job
    page.locator('tr[data-job="local/tiny"][data-phase="Succeeded"]').wait_for()  # live update, no reload
    cells = row.locator("td")
    assert cells.nth(2).inner_text() == f"Z{job['plan']['zeroStage']} opt:{job['plan']['optimizer']} " \
        f"par:{job['plan']['parameters']}"
    assert cells.nth(3).inner_text().startswith("6/6")
    cost = api.get(base + "/cost").json()
    assert cells.nth(4).inner_text() == f"${cost['usd']:.4f}"

    page.select_option("#filter-phase", "Failed")
    page.locator('tr[data-job="local/tiny"]').wait_for(state="detached")
    assert page.locator("tr[data-job]").count() == 1
    page.select_option("#filter-phase", "")
    page.select_option("#filter-namespace", "local")
    page.locator('tr[data-job="team-b/refused"]').wait_for(state="detached")
    row.wait_for()
    page.select_option("#filter-namespace", "")
    page.locator('tr[data-job="team-b/refused"]').wait_for()
    shot(page, "1-jobs")

    # -- detail: one loss point per recorded step, markers, tiers, plan, cost -------------------
    row.get_by_role("link", name="tiny").click()
    loss = page.locator("#loss-chart")
    history = api.get(base + "/history").json()
    assert history["progressCount"] == 6
    page.locator('#loss-chart[data-points="6"]').wait_for()
    assert "LoRA rank 8" in page.locator("#summary").inner_text()
    assert loss.get_attribute("data-checkpoints") == "3" and loss.get_attribute("data-restarts") == "0"
    assert page.locator("#loss-chart canvas").count() == 1 and page.locator("#tput-chart canvas").count() == 1
    # uPlot's own data: one x per recorded step, the losses the API recorded, and the
    # held-out losses (every 3 steps) as a second line
    xs, *ys = page.evaluate("document.querySelector('#loss-chart').uplot.data")
    assert xs == [p["step"] for p in history["progress"]]
    evals = {e["step"]: e["loss"] for e in history["evaluations"]}
    assert sorted(evals) == [3, 6] and loss.get_attribute("data-evaluations") == "2"
    assert ys == [[p["loss"] for p in history["progress"]], [evals.get(s) for s in xs]]
    assert page.evaluate("document.querySelector('#loss-chart').uplot.series[2].label") == "held-out"
    # the rewards chart: TRL's rewards/margins and rewards/accuracies of every step, and the
    # held-out pairs' at the evaluated steps
    page.locator('#rewards-chart[data-points="6"]').wait_for()
    steps, margins, accuracies, held_margins, held_accuracies = page.evaluate(
        "document.querySelector('#rewards-chart').uplot.data")
    assert steps == xs and all(p["preference"] for p in history["progress"])
    assert margins == [p["preference"]["rewards/margins"] for p in history["progress"]]
    assert accuracies == [p["preference"]["rewards/accuracies"] for p in history["progress"]]
    held = {e["step"]: e["preference"] for e in history["evaluations"]}
    assert held_margins == [held[s]["rewards/margins"] if s in held else None for s in steps]
    assert held_accuracies == [held[s]["rewards/accuracies"] if s in held else None for s in steps]
    assert page.locator("#marker-list li[data-kind=checkpoint]").count() == 3
    for tier in ("gpu", "cpu", "nvme"):
        bar = page.locator(f'.tier[data-tier="{tier}"]')
        assert int(bar.get_attribute("data-bytes")) == job["plan"]["bytes"][tier]
        assert int(bar.get_attribute("data-capacity")) == job["plan"]["capacity"][tier]
    assert page.locator("#plan-reasons li").count() == len(job["plan"]["reasons"])
    assert page.locator("#plan-rejected li").count() == len(job["plan"]["rejected"])
    assert page.locator("#cost-accrued").inner_text() == f"${cost['usd']:.4f}"
    # the steps' measured time beside the plan's prediction (the mean of the last steps, each
    # process's first left out), as the run's events gave it
    progress = job["progress"]
    assert progress["stepSeconds"] > 0
    assert abs(progress["stepTimeVsPlan"] - progress["stepSeconds"] / job["plan"]["predictedStepSeconds"]) < 2e-3
    measured = page.locator("#step-measured")
    assert float(measured.get_attribute("data-seconds")) == progress["stepSeconds"]
    [shown] = re.findall(r"\(([0-9.]+)x\)", measured.inner_text())
    assert abs(float(shown) - progress["stepTimeVsPlan"]) <= 0.005 * progress["stepTimeVsPlan"], measured.inner_text()
    shot(page, "2-detail")

    # -- rollback: keyboard-reachable button, confirmation, reason required --------------------
    button = page.get_by_role("button", name="Roll back to step-00000002")
    button.focus()
    page.keyboard.press("Enter")
    confirm = page.locator("#rollback-dialog")
    confirm.wait_for(state="visible")
    assert page.evaluate("document.activeElement.id") == "rollback-reason"
    page.click("#rollback-confirm")  # no reason: the form refuses, nothing is sent
    assert confirm.is_visible()
    assert api.get(base).json()["spec"].get("resumeFrom") is None
    page.keyboard.press("Escape")  # cancel returns focus to the button
    confirm.wait_for(state="detached")
    assert page.evaluate("document.activeElement.getAttribute('aria-label')") == "Roll back to step-00000002"
    page.keyboard.press("Enter")
    page.fill("#rollback-reason", "loss spike after step 2")
    shot(page, "3-rollback-dialog")
    page.click("#rollback-confirm")
    confirm.wait_for(state="detached")
    rolled = api.get(base + "/history").json()["rollbacks"]
    assert [(x["checkpoint"], x["reason"], x["origin"]) for x in rolled] == [
        ("step-00000002", "loss spike after step 2", "api")]
    spec_after = api.get(base).json()["spec"]
    # resumeFrom is set by the rollback; the local launcher clears it once the restart completed
    assert spec_after.get("resumeFrom") == "step-00000002" or rolled[0]["completedAt"], spec_after

    page.locator('#restart-banner[data-state="restarted"][data-checkpoint="step-00000002"]').wait_for(timeout=120_000)
    wait_for(lambda: api.get(base).json()["phase"] == "Succeeded" and api.get(base).json()["exitCode"] == 0, 120,
             "the restarted run to finish")
    history = api.get(base + "/history").json()
    assert [p["step"] for p in history["progress"]] == [1, 2, 3, 4, 5, 6, 3, 4, 5, 6]
    page.locator(f'#loss-chart[data-points="{history["progressCount"]}"][data-restarts="1"]').wait_for()
    assert loss.get_attribute("data-runs") == "2" and loss.get_attribute("data-rollbacks") == "1"
    assert page.locator("#marker-list li[data-kind=restart]").inner_text() == "restarted at step 2"
    assert "Restarted from step-00000002" in page.locator("#restart-banner").inner_text()
    # Each run its own row: the first kept its outcome when the rollback started the second.
    page.locator('#attempt-table tr[data-attempt="2"][data-phase="Succeeded"]').wait_for()
    rows = [[c.inner_text() for c in page.locator(f'#attempt-table tr[data-attempt="{n}"] > *').all()] for n in (1, 2)]
    assert [r[:4] for r in rows] == [["1", "submit", "Succeeded", "1\u20136"], ["2", "restart", "Succeeded", "3\u20136"]], rows
    attempts = api.get(base + "/attempts").json()["data"]
    assert [r[7] for r in rows] == [f"${a['usd']:.4f}" if a["usd"] < 1 else f"${a['usd']:.2f}" for a in attempts]
    shot(page, "4-detail-after-rollback")

    # -- plan explorer: the page's numbers are POST /v1/plan's --------------------------------
    page.get_by_role("link", name="Plan explorer").click()
    page.fill("#plan-params", "13B")
    page.click("#plan-compare")
    page.locator("#plan-table").wait_for()
    heads = page.locator("#plan-table thead th[data-node]")
    assert heads.count() == 3
    compared = []
    for i in range(heads.count()):
        request = json.loads(heads.nth(i).get_attribute("data-request"))
        compared.append(request)
        assert request["parameterCount"] == "13B"
        answer = api.post("/v1/plan", json=request)
        assert answer.status_code == 200, answer.text
        want = answer.json()["data"][0]
        assert heads.nth(i).inner_text() == want["node"]

        def cell(field: str, col: int = i) -> Any:
            return page.locator(f'#plan-table tbody td[data-field="{field}"]').nth(col)

        assert cell("label").get_attribute("data-value") == want["label"]
        assert cell("feasible").get_attribute("data-value") == str(want["feasible"]).lower()
        for tier in ("gpu", "cpu", "nvme"):
            assert int(cell(f"bytes.{tier}").get_attribute("data-value")) == want["plan"]["bytes"][tier]
        assert float(cell("predictedStepSeconds").get_attribute("data-value")) == want["plan"]["predictedStepSeconds"]
        assert float(cell("predictedCostUsd").get_attribute("data-value")) == want["plan"]["predictedCostUsd"]
        assert cell("predictedCostUsd").inner_text().splitlines()[0] == f"${want['plan']['predictedCostUsd']:.2f}"
    shot(page, "5-plan-explorer")

    # -- the largest model per shape: the same form, no size, POST /v1/plan's `largest` -------
    page.click("#plan-largest")
    page.locator("#largest-table").wait_for()
    heads = [h.get_attribute("data-node") for h in page.locator("#largest-table thead th[data-node]").all()]
    assert heads == [r["hardware"]["name"] for r in compared]
    for request in compared:
        del request["parameterCount"]
        [want] = api.post("/v1/plan", json=request).json()["largest"]
        node = want["node"]
        for fit in want["placements"]:
            shown = page.locator(f'#largest-table td[data-node="{node}"][data-placement="{fit["placement"]}"]')
            if fit["whyNot"]:
                assert shown.inner_text() == fit["whyNot"]
            else:
                assert int(shown.get_attribute("data-value")) == fit["parameters"]
    first = {c.get_attribute("data-placement"): int(c.get_attribute("data-value"))
             for c in page.locator(f'#largest-table td[data-node="{heads[0]}"][data-value]').all()}
    assert first["Z3 opt:nvme par:nvme"] > first["Z3 opt:cpu par:cpu"] > 0
    shot(page, "6-largest-model")

    # -- the cluster's nodes, planned as for a namespace the caller may create jobs in: the
    # API's SubjectAccessReview asks about it (here, local mode, this machine answers)
    page.fill("#plan-namespace", "team-a")
    page.click("#plan-cluster")
    page.wait_for_function("document.querySelectorAll('#plan-table thead th[data-node]').length == 1")
    assert any(u.endswith("/v1/plan?namespace=team-a") for u in requests), [u for u in requests if "/plan" in u]

    # everything came from the API's own origin; no script errors
    assert all(u.startswith(server["url"]) for u in requests), [u for u in requests if not u.startswith(server["url"])]
    assert not problems, problems
    context.close()


def test_pages_are_public_and_data_needs_the_token(make_client: Any, tmp_path: Path) -> None:
    """The page and bundle carry no data and load without a token; /v1 still needs it."""
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'api.db'}", data_dir=tmp_path / "data", auth="token")
    anon = make_client(settings, authenticated=False)
    page = anon.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'src="assets/app.js"' in page.text
    js = anon.get("/assets/app.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert anon.get("/assets/app.css").headers["content-type"].startswith("text/css")
    for bad in ("/assets/..%2Fdashboard.py", "/assets/nope.js", "/assets/THIRD-PARTY-LICENSES.txt"):
        assert anon.get(bad).status_code == 404, bad
    assert anon.get("/v1/jobs").status_code == 401
    authed = make_client(settings)
    assert authed.get("/v1/jobs").json() == {"data": [], "count": 0}
    assert authed.get("/v1/jobs", params={"namespace": "Bad_NS"}).status_code == 422


def test_no_auth_asks_for_nothing(browser: Any, tmp_path: Path) -> None:
    """With --no-auth the page never shows the token dialog and stores no token."""
    with serve(tmp_path, "none") as srv:
        page = browser.new_page()
        page.goto(srv["url"] + "/#/jobs")
        page.locator("#jobs-status", has_text="0 jobs").wait_for(timeout=15_000)
        assert not page.locator("#token-dialog").is_visible()
        assert page.evaluate("sessionStorage.getItem('spillway.token')") is None
        assert page.locator("#forget-token").is_hidden()
        page.close()
        # No credential guards it, so only its loopback names are answered: a page whose own
        # name was made to resolve to 127.0.0.1 (DNS rebinding) gets nothing.
        port = srv["url"].rsplit(":", 1)[1]
        for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
            assert httpx.get(srv["url"] + "/v1/jobs", headers={"Host": host}).status_code == 200, host
        for host in (f"rebind.example:{port}", "rebind.example", f"127.0.0.1.rebind.example:{port}"):
            refused = httpx.get(srv["url"] + "/v1/jobs", headers={"Host": host})
            assert refused.status_code == 400 and "Invalid host header" in refused.text, (host, refused.text)
