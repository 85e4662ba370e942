#!/usr/bin/env bash
# A throwaway PostgreSQL server for the API's tests and benchmark.
#
#   hack/postgres.sh start   initdb (once) and start; prints the database URL
#   hack/postgres.sh url     prints the URL of the running server
#   hack/postgres.sh stop    stops it (the data directory stays for the next start)
#   hack/postgres.sh destroy stops it and removes the data directory
#
# Data, socket and log live in $SPILLWAY_PG_DIR (default ${SPILLWAY_CACHE:-~/.cache/spillway}/pg).
# PostgreSQL refuses to run as root, so as root the server runs as the `postgres` system user
# (created when missing). It listens on 127.0.0.1 only, on a free port chosen at first start.
set -euo pipefail

PG_DIR="${SPILLWAY_PG_DIR:-${SPILLWAY_CACHE:-$HOME/.cache/spillway}/pg}"
DATA="$PG_DIR/data"
PORT_FILE="$PG_DIR/port"
LOG="$PG_DIR/server.log"
DB_USER=spillway
DB_NAME=spillway

find_bin() {
  local candidate
  for candidate in /usr/lib/postgresql/*/bin; do
    if [[ -x "$candidate/pg_ctl" ]]; then echo "$candidate"; return; fi
  done
  if command -v pg_ctl >/dev/null; then dirname "$(command -v pg_ctl)"; return; fi
  echo "postgres.sh: no PostgreSQL found (apt-get install postgresql)" >&2
  exit 1
}
BIN="$(find_bin)"

as_owner() {
  if [[ "$(id -u)" == 0 ]]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

url() {
  [[ -f "$PORT_FILE" ]] || { echo "postgres.sh: not initialised ($PG_DIR)" >&2; exit 1; }
  echo "postgresql+psycopg://$DB_USER@127.0.0.1:$(cat "$PORT_FILE")/$DB_NAME"
}

running() {
  [[ -f "$DATA/postmaster.pid" ]] && as_owner "$BIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1
}

start() {
  if [[ "$(id -u)" == 0 ]] && ! id postgres >/dev/null 2>&1; then
    useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres
  fi
  mkdir -p "$PG_DIR"
  if [[ "$(id -u)" == 0 ]]; then
    chown postgres "$PG_DIR"
    # runuser needs to traverse the parents of a directory under /root
    dir="$PG_DIR"
    while [[ "$dir" != / ]]; do dir="$(dirname "$dir")"; chmod o+x "$dir" 2>/dev/null || true; done
  fi
  if [[ ! -f "$DATA/PG_VERSION" ]]; then
    as_owner "$BIN/initdb" -D "$DATA" -U "$DB_USER" --auth=trust --encoding=UTF8 --no-sync >"$PG_DIR/initdb.log" 2>&1 \
      || { cat "$PG_DIR/initdb.log" >&2; exit 1; }
    free_port >"$PORT_FILE"
    {
      echo "listen_addresses = '127.0.0.1'"
      echo "port = $(cat "$PORT_FILE")"
      echo "unix_socket_directories = '$PG_DIR'"
      # a test server: durability is not the point, speed is
      echo "fsync = off"
      echo "synchronous_commit = off"
      echo "full_page_writes = off"
      echo "max_connections = 200"
    } >>"$DATA/postgresql.conf"
  fi
  if ! running; then
    as_owner "$BIN/pg_ctl" -D "$DATA" -l "$LOG" -w -t 60 start >/dev/null \
      || { echo "postgres.sh: server did not start; log:" >&2; tail -30 "$LOG" >&2; exit 1; }
  fi
  local port; port="$(cat "$PORT_FILE")"
  if ! as_owner "$BIN/psql" -h 127.0.0.1 -p "$port" -U "$DB_USER" -d postgres -tAc \
      "SELECT 1 FROM pg_database WHERE datname='$DB_NAME'" | grep -q 1; then
    as_owner "$BIN/createdb" -h 127.0.0.1 -p "$port" -U "$DB_USER" "$DB_NAME"
  fi
  url
}

stop() {
  if running; then as_owner "$BIN/pg_ctl" -D "$DATA" -m fast -w stop >/dev/null; fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  url) url ;;
  destroy) stop; rm -rf "$PG_DIR" ;;
  *) echo "usage: $0 start|stop|url|destroy" >&2; exit 2 ;;
esac
