// Bundles src/main.js (+ uPlot and its CSS) into ../api/spillway_api/static/ with fixed file
// names, and copies index.html beside it. No hashes, no timestamps: the same sources give the
// same bytes, so a rebuild of an unchanged tree leaves `git status` clean.
import { build } from "esbuild";
import { createHash } from "node:crypto";
import { copyFileSync, mkdirSync, readFileSync, readdirSync, rmSync, statSync, writeFileSync } from "node:fs";
import { dirname, join, relative } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const out = join(here, "..", "api", "spillway_api", "static");
mkdirSync(out, { recursive: true });
for (const f of readdirSync(out)) rmSync(join(out, f), { recursive: true });

await build({
  entryPoints: { app: join(here, "src", "main.js") },
  bundle: true,
  minify: true,
  format: "esm",
  target: ["es2020"],
  outdir: out,
  legalComments: "linked",
  logLevel: "info",
});
copyFileSync(join(here, "index.html"), join(out, "index.html"));
// uPlot is MIT-licensed: its notice ships with the bundle.
copyFileSync(join(here, "node_modules", "uplot", "LICENSE"), join(out, "THIRD-PARTY-LICENSES.txt"));

// What the bundle was built from: sha256 over each input's path and bytes, in path order.
// tests/unit/api/test_dashboard_bundle.py recomputes it, so an edited source with a stale
// bundle fails the tests.
const inputs = ["build.mjs", "index.html", "package.json", "package-lock.json"];
const walk = (dir) => {
  for (const name of readdirSync(dir)) {
    const path = join(dir, name);
    if (statSync(path).isDirectory()) walk(path);
    else inputs.push(relative(here, path));
  }
};
walk(join(here, "src"));
const hash = createHash("sha256");
for (const name of inputs.sort()) {
  hash.update(name + "\0");
  hash.update(readFileSync(join(here, name)));
  hash.update("\0");
}
writeFileSync(join(out, "SOURCES.sha256"), hash.digest("hex") + "\n");
