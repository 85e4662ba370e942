// Entry point: a hash router over three pages. Each page returns a function that stops its polling.
import "./style.css";
import { forgetToken, hasToken } from "./api.js";
import { detailPage } from "./detail.js";
import { jobsPage } from "./jobs.js";
import { planPage } from "./plan.js";

const main = document.getElementById("main");
let stop = () => {};

function route() {
  stop();
  const [path, query] = (location.hash.replace(/^#/, "") || "/jobs").split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  let page = "jobs";
  if (parts[0] === "plan") {
    page = "plan";
    stop = planPage(main);
  } else if (parts[0] === "jobs" && parts.length === 3) {
    stop = detailPage(main, parts[1], parts[2]);
  } else {
    document.title = "Jobs · Spillway";
    stop = jobsPage(main, new URLSearchParams(query || ""));
  }
  for (const a of document.querySelectorAll("[data-nav]")) {
    if (a.dataset.nav === page) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  // Move focus to the new page, as a full navigation would (screen readers announce it).
  if (document.activeElement && document.activeElement !== document.body) main.focus({ preventScroll: true });
}

const forget = document.getElementById("forget-token");
forget.hidden = !hasToken();
forget.addEventListener("click", () => { forgetToken(); location.reload(); });
window.addEventListener("hashchange", route);
route();
