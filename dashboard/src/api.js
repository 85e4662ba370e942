// Calls to the API with the bearer token kept in sessionStorage. A 401 asks for the token
// (once, however many calls were refused at the same time) and retries; with --no-auth the
// API never answers 401, so nothing is asked.
const KEY = "spillway.token";
let asking = null;

export class ApiError extends Error {
  constructor(status, problem) {
    super(problem?.detail || `HTTP ${status}`);
    this.status = status;
    this.problem = problem || {};
  }
}

export function hasToken() {
  return !!sessionStorage.getItem(KEY);
}

export function forgetToken() {
  sessionStorage.removeItem(KEY);
}

function askToken(why) {
  if (asking) return asking;
  const dialog = document.getElementById("token-dialog");
  const input = document.getElementById("token-input");
  const form = document.getElementById("token-form");
  if (why) document.getElementById("token-why").textContent = why;
  const before = document.activeElement;
  input.value = "";
  asking = new Promise((resolve) => {
    const done = (ev) => {
      const token = input.value.trim();
      if (!token) { ev.preventDefault(); return; }
      sessionStorage.setItem(KEY, token);
      form.removeEventListener("submit", done);
      dialog.addEventListener("close", () => {
        asking = null;
        if (before && before.focus) before.focus();
        resolve();
      }, { once: true });
    };
    form.addEventListener("submit", done);
    // Escape would leave the page without a token: keep the dialog until one is given.
    dialog.addEventListener("cancel", (ev) => ev.preventDefault());
  });
  dialog.showModal();
  input.focus();
  return asking;
}

export async function api(path, { method = "GET", body } = {}) {
  for (;;) {
    const headers = { Accept: "application/json" };
    const token = sessionStorage.getItem(KEY);
    if (token) headers.Authorization = `Bearer ${token}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    // Relative to the page, so the dashboard also works behind a path prefix.
    const r = await fetch(path.replace(/^\//, ""), {
      method, headers, body: body === undefined ? undefined : JSON.stringify(body),
    });
    let data = null;
    const text = await r.text();
    try { data = text ? JSON.parse(text) : null; } catch { data = { detail: text }; }
    if (r.status === 401) {
      if (token) forgetToken();
      await askToken(token ? `The token was refused: ${data?.detail || ""} Enter another.` : null);
      document.getElementById("forget-token").hidden = false;
      continue;
    }
    if (!r.ok) throw new ApiError(r.status, data);
    return data;
  }
}
