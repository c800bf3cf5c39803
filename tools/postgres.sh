#!/usr/bin/env bash
# A throwaway PostgreSQL cluster for the tests that need a real server (tests/test_jobs_db.py,
# tests/test_serve_postgres.py): Debian's postgresql package, installed if missing, a new
# cluster in a temporary folder, listening on loopback only, trust auth (it never leaves
# 127.0.0.1 and is removed on stop).
#
#   eval "$(tools/postgres.sh start)"   # prints: export GENERATE_FLAX_TEST_POSTGRES=...
#   tools/postgres.sh stop
set -euo pipefail
PORT=${PGPORT_TEST:-54329}
DIR=${PGDATA_TEST:-/tmp/generate-flax-pg-$PORT}
SUDO=$( [ "$(id -u)" -eq 0 ] || echo sudo )

pg_bin() {
  ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1
}

as_owner() {  # initdb and postgres refuse to run as root: run them as the postgres user
  if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

case "${1:-}" in
  start)
    if [ -z "$(pg_bin)" ]; then
      $SUDO apt-get update -qq >&2
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql >&2
    fi
    BIN=$(pg_bin)
    if [ -f "$DIR/postmaster.pid" ]; then as_owner "$BIN/pg_ctl" -D "$DIR" -m fast stop >&2 || true; fi
    rm -rf "$DIR" && mkdir -p "$DIR"
    [ "$(id -u)" -eq 0 ] && chown postgres "$DIR"
    as_owner "$BIN/initdb" -D "$DIR" -U postgres -A trust --no-sync >/dev/null
    # fsync stays on: the store's durability is part of what the tests exercise.
    as_owner "$BIN/pg_ctl" -D "$DIR" -l "$DIR/server.log" -w \
      -o "-c listen_addresses=127.0.0.1 -p $PORT -k $DIR -c max_connections=200" start >&2
    echo "export GENERATE_FLAX_TEST_POSTGRES=postgresql://postgres@127.0.0.1:$PORT/postgres"
    ;;
  stop)
    BIN=$(pg_bin)
    if [ -n "$BIN" ] && [ -f "$DIR/postmaster.pid" ]; then
      as_owner "$BIN/pg_ctl" -D "$DIR" -m fast stop >&2
    fi
    rm -rf "$DIR"
    ;;
  *)
    echo "usage: tools/postgres.sh start|stop" >&2
    exit 2
    ;;
esac
