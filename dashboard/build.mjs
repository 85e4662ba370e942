// Bundles src/main.js (+ uPlot and its CSS) into ../api/spillway_api/static/ with fixed file
// names, and copies index.html beside it. No hashes, no timestamps: the same sources give the
// same bytes, so a rebuild of an unchanged tree leaves `git status` clean.
import { build } from "esbuild";
import { copyFileSync, mkdirSync, readdirSync, rmSync } from "node:fs";
import { dirname, join } from "node:path";
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
