#!/usr/bin/env bash
# Rebuild the dashboard bundle (api/spillway_api/static/, committed) from dashboard/:
# the exact dependency versions of dashboard/package-lock.json, then esbuild.
# Node is needed only here; the Python package serves the committed bundle without it.
set -euo pipefail
cd "$(dirname "$0")/../dashboard"
npm ci --no-audit --no-fund
npm run build
