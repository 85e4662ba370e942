// Number and text formatting shared by the pages.
export function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let v = Number(n);
  let i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return `${v.toFixed(i === 0 ? 0 : v >= 100 ? 0 : 1)} ${units[i]}`;
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) return "–";
  const s = Math.round(seconds);
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

export function stepSeconds(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  return seconds < 10 ? `${seconds.toFixed(2)} s` : `${seconds.toFixed(1)} s`;
}

export function usd(v) {
  if (v === null || v === undefined) return "–";
  return `$${Number(v).toFixed(v !== 0 && Math.abs(v) < 1 ? 4 : 2)}`;
}

export function age(iso) {
  return iso ? duration((Date.now() - Date.parse(iso)) / 1000) : "–";
}

export function time(iso) {
  return iso ? new Date(iso).toLocaleString() : "–";
}

export function num(v, digits = 4) {
  return v === null || v === undefined ? "–" : Number(v).toPrecision(digits);
}

/** 'Z3 opt:nvme par:cpu', as the CRD's printer column shows it. */
export function planLabel(plan) {
  return plan?.label || "–";
}

/** Element builder: h("td", {class: "x"}, "text", child). */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export function errorBox(err) {
  return h("p", { class: "error", role: "alert" }, err instanceof Error ? err.message : String(err));
}
