#!/usr/bin/env bash
# The whole test suite, from a fresh clone: starts PostgreSQL and Redis when they
# are not running (installing them with apt-get on Debian when they are absent),
# then runs go vet, the module hygiene checks (scripts/hygiene.sh: go mod tidy
# changes nothing, staticcheck, govulncheck), go test -race on every package,
# and one short round of the bench/ module's peer benchmarks, for their
# lost-update checks (each contender's counter must end exact).
#
# Environment:
#   FENCEKIT_POSTGRES_URL  default postgres://postgres@127.0.0.1:5432/test?sslmode=disable
#   FENCEKIT_REDIS_ADDR    default 127.0.0.1:6379
#   FENCEKIT_MYSQL_DSN     default fencekit:fencekit@tcp(127.0.0.1:3306)/test
#                          (go-sql-driver/mysql format; MariaDB or MySQL 8)
#   FENCEKIT_S3_ENDPOINT   an S3-compatible server for the S3 tests instead of
#                          a versitygw they start (with FENCEKIT_S3_ACCESS_KEY,
#                          FENCEKIT_S3_SECRET_KEY, FENCEKIT_S3_REGION and
#                          FENCEKIT_S3_BUCKET), for example MinIO or AWS
#   FENCEKIT_AZURE_URL     an Azure blob service URL for the Azure tests instead
#                          of an Azurite they start (with FENCEKIT_AZURE_ACCOUNT,
#                          FENCEKIT_AZURE_KEY and FENCEKIT_AZURE_CONTAINER)
#   FENCEKIT_NO_SERVICES=1 do not start or install anything (tests that need a
#                          missing server then skip, or fail when CI is set)
#   GO_TEST_FLAGS          extra flags for go test (for example -run Postgres)
set -euo pipefail
cd "$(dirname "$0")/.."

export FENCEKIT_POSTGRES_URL="${FENCEKIT_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test?sslmode=disable}"
export FENCEKIT_REDIS_ADDR="${FENCEKIT_REDIS_ADDR:-127.0.0.1:6379}"

say() { printf 'test.sh: [%ds] %s\n' "$SECONDS" "$*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else say "need root for: $*"; return 1; fi; }
apt_updated=
apt_install() {
  command -v apt-get >/dev/null || { say "no apt-get: install $* yourself"; return 1; }
  if [ -z "$apt_updated" ]; then as_root apt-get update -qq; apt_updated=1; fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

pg_up() { command -v pg_isready >/dev/null && pg_isready -q -h 127.0.0.1 -p 5432; }

start_postgres() {
  pg_up && return 0
  local fresh=
  if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
    say "PostgreSQL is not installed: installing it with apt-get"
    apt_install postgresql postgresql-client
    fresh=1
  fi
  local ver; ver=$(ls /etc/postgresql | sort -V | tail -n 1)
  if [ -n "$fresh" ]; then
    # A server installed here only for the tests: trust loopback connections.
    local hba=/etc/postgresql/$ver/main/pg_hba.conf
    as_root sed -i -E 's/^(host\s+all\s+all\s+(127\.0\.0\.1\/32|::1\/128)\s+)\S+/\1trust/' "$hba"
  fi
  say "starting PostgreSQL $ver"
  as_root pg_ctlcluster --skip-systemctl-redirect "$ver" main start || as_root pg_ctlcluster "$ver" main start
  for _ in $(seq 1 50); do pg_up && break; sleep 0.2; done
  pg_up || { say "PostgreSQL did not start"; return 1; }
}

ensure_test_db() {
  command -v psql >/dev/null || return 0
  if ! psql "$FENCEKIT_POSTGRES_URL" -Atc 'select 1' >/dev/null 2>&1; then
    local db; db=$(sed -E 's#.*/([^/?]+)(\?.*)?$#\1#' <<<"$FENCEKIT_POSTGRES_URL")
    say "creating database $db"
    as_root su postgres -c "psql -qc 'CREATE DATABASE \"$db\"'" >/dev/null 2>&1 || true
  fi
}

redis_up() { command -v redis-cli >/dev/null && redis-cli -h "${FENCEKIT_REDIS_ADDR%:*}" -p "${FENCEKIT_REDIS_ADDR##*:}" ping 2>/dev/null | grep -q PONG; }

start_redis() {
  # The Redlock, failover, Cluster and Sentinel tests start redis-server
  # processes of their own, so the binary is needed even when a server runs.
  if ! command -v redis-server >/dev/null; then
    say "Redis is not installed: installing it with apt-get"
    if ! apt_install redis-server redis-tools; then
      redis_up || return 1
      say "no redis-server binary: the tests that start their own Redis processes will skip (or fail under CI)"
    fi
  fi
  redis_up && return 0
  say "starting Redis"
  as_root mkdir -p /var/lib/redis /var/log/redis
  as_root redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  for _ in $(seq 1 50); do redis_up && break; sleep 0.2; done
  redis_up || { say "Redis did not start"; return 1; }
}

# MariaDB (or MySQL) for the sqlfence MySQL tests: started, and installed with
# apt-get when absent, with a database "test" and a user fencekit/fencekit that
# the default FENCEKIT_MYSQL_DSN uses. A DSN given in FENCEKIT_MYSQL_DSN is used
# as it is.
mysql_up() { # the test user can log in (mariadb-admin ping succeeds even when access is denied)
  command -v mariadb >/dev/null && mariadb --protocol=tcp -h 127.0.0.1 -P 3306 -u fencekit -pfencekit -e 'SELECT 1' test >/dev/null 2>&1
}
mysql_server_up() {
  command -v mariadb-admin >/dev/null && mariadb-admin --protocol=tcp -h 127.0.0.1 -P 3306 ping 2>&1 | grep -qE "alive|Access denied"
}
# The server's time zone tables (mysql.time_zone*), which the daylight-saving
# test of sqlfence needs (a named zone in the session): filled from the
# system's zoneinfo when empty. This adds rows and changes no setting; a
# failure only makes that test skip (or fail under CI).
mysql_tz_tables() {
  local n
  n=$(as_root mariadb -N -B -e 'SELECT COUNT(*) FROM mysql.time_zone_name' 2>/dev/null) || return 0
  [ "$n" = 0 ] || return 0
  command -v mariadb-tzinfo-to-sql >/dev/null && [ -d /usr/share/zoneinfo ] || {
    say "no mariadb-tzinfo-to-sql or /usr/share/zoneinfo: the MySQL time zone test will skip (or fail under CI)"; return 0; }
  say "loading MariaDB's time zone tables from /usr/share/zoneinfo"
  { mariadb-tzinfo-to-sql /usr/share/zoneinfo 2>/dev/null | as_root mariadb mysql >/dev/null 2>&1; } ||
    say "could not load MariaDB's time zone tables: the MySQL time zone test will skip (or fail under CI)"
}
# The MySQL tests run many acquirers at once (8 parallel tests, and each
# acquirer pins connections for its bells): the default 151 connections ran
# out in a run beside other work, so the server the tests start, or find, gets
# more (not saved: a restart goes back to the server's own setting).
mysql_max_connections() {
  as_root mariadb -e "SET GLOBAL max_connections = GREATEST(@@max_connections, 1000)" >/dev/null 2>&1 ||
    say "could not raise MariaDB's max_connections (the MySQL tests may run out of connections)"
}
start_mysql() {
  [ -n "${FENCEKIT_MYSQL_DSN:-}" ] && return 0
  mysql_up && { mysql_tz_tables; mysql_max_connections; return 0; }
  if ! command -v mariadbd >/dev/null && ! [ -x /usr/sbin/mariadbd ]; then
    say "MariaDB is not installed: installing it with apt-get"
    apt_install mariadb-server mariadb-client || { say "could not install MariaDB: the MySQL tests will skip (or fail under CI)"; return 0; }
  fi
  if ! mysql_server_up; then
    say "starting MariaDB"
    as_root mkdir -p /run/mysqld && as_root chown mysql:mysql /run/mysqld 2>/dev/null || true
    as_root start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd || as_root service mariadb start || true
    for _ in $(seq 1 100); do mysql_server_up && break; sleep 0.2; done
  fi
  mysql_server_up || { say "MariaDB did not start: the MySQL tests will skip (or fail under CI)"; return 0; }
  as_root mariadb -e "CREATE DATABASE IF NOT EXISTS test;
    CREATE USER IF NOT EXISTS 'fencekit'@'127.0.0.1' IDENTIFIED BY 'fencekit';
    CREATE USER IF NOT EXISTS 'fencekit'@'localhost' IDENTIFIED BY 'fencekit';
    GRANT ALL ON test.* TO 'fencekit'@'127.0.0.1';
    GRANT ALL ON test.* TO 'fencekit'@'localhost';" || say "could not create the MariaDB test user"
  mysql_tz_tables
  mysql_max_connections
}

# versitygw, the real S3-compatible server of the S3 tests (they start it
# themselves, on a temporary folder); installed with go install when missing.
VERSITYGW=github.com/versity/versitygw/cmd/versitygw@v1.8.0
ensure_versitygw() {
  [ -n "${FENCEKIT_S3_ENDPOINT:-}" ] && return 0
  local gobin; gobin="$(go env GOPATH)/bin"
  export PATH="$PATH:$gobin"
  command -v versitygw >/dev/null && return 0
  say "versitygw is not installed: go install $VERSITYGW (about 2 minutes)"
  go install "$VERSITYGW" || say "could not install versitygw: its tests will skip (or fail under CI)"
}

# Azurite, the Azure Storage emulator of the Azure tests (they start it
# themselves, on a temporary folder); installed with npm when missing, into
# a cache folder the tests find through FENCEKIT_AZURITE_DIR.
AZURITE=azurite@3.37.0
ensure_azurite() {
  [ -n "${FENCEKIT_AZURE_URL:-}" ] && return 0
  command -v azurite-blob >/dev/null && return 0
  export FENCEKIT_AZURITE_DIR="${FENCEKIT_AZURITE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/fencekit/azurite}"
  [ -x "$FENCEKIT_AZURITE_DIR/node_modules/.bin/azurite-blob" ] && return 0
  command -v npm >/dev/null || { say "npm is missing: the Azure tests will skip (or fail under CI)"; return 0; }
  say "Azurite is not installed: npm install $AZURITE into $FENCEKIT_AZURITE_DIR"
  mkdir -p "$FENCEKIT_AZURITE_DIR"
  npm install --prefix "$FENCEKIT_AZURITE_DIR" --no-audit --no-fund "$AZURITE" >/dev/null ||
    say "could not install Azurite: its tests will skip (or fail under CI)"
}

installs=()
if [ "${FENCEKIT_NO_SERVICES:-}" != 1 ]; then
  # The two emulator installs download most of their time: they go on in the
  # background while the servers start and go vet and the hygiene checks run.
  ensure_versitygw & installs+=($!)
  ensure_azurite & installs+=($!)
  start_postgres
  ensure_test_db
  start_redis
  start_mysql
fi

say "go vet ./... (and the bench module)"
go vet ./...
(cd bench && go vet ./...)
say "module hygiene: go mod tidy, staticcheck, govulncheck"
scripts/hygiene.sh
for p in "${installs[@]}"; do wait "$p" || true; done
# What the installs exported in their subshells, again for the tests.
export PATH="$PATH:$(go env GOPATH)/bin"
if [ -z "${FENCEKIT_AZURE_URL:-}" ] && ! command -v azurite-blob >/dev/null; then
  export FENCEKIT_AZURITE_DIR="${FENCEKIT_AZURITE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/fencekit/azurite}"
fi
# The etcd members of the tests run as child processes of a binary built once
# here without the race detector (internal/etcdtest): inside a race-built test
# binary under the run's own load, an embedded etcd stalled for seconds.
etcd_node_dir=$(mktemp -d)
trap 'rm -rf "$etcd_node_dir"' EXIT
go build -o "$etcd_node_dir/etcdnode" ./internal/etcdtest/etcdnode
export FENCEKIT_ETCD_NODE="$etcd_node_dir/etcdnode"
say "go test -race ./... (4 packages and 8 parallel tests each at a time: most of their time is spent waiting on leases and servers, and more packages at once on 2 CPUs starved the timing-sensitive cases)"
# shellcheck disable=SC2086
go test -race -count=1 -p 4 -parallel 8 -timeout 30m ${GO_TEST_FLAGS:-} ./...

# The bench/ module's peer benchmarks fail when a contender's counter does not
# end exact (lost updates). One round of 20 workers x 5 increments per
# contender, in this process and across 4 child processes: about 5s (10s with
# the build) on a loaded 2-CPU machine. Nothing is asserted about speed.
say "bench/: the peers' lost-update checks, one short round"
bench_out=$(cd bench && BENCH_ROUNDS=1 BENCH_EACH=5 go test -count=1 -run '^$' -bench 'Peers' -benchtime 1x . 2>&1) || {
  printf '%s\n' "$bench_out"; say "bench/: FAIL"; exit 1; }
if grep -q -- '--- SKIP' <<<"$bench_out"; then
  printf '%s\n' "$bench_out"
  if [ -n "${CI:-}" ]; then say "bench/: FAIL: skipped under CI"; exit 1; fi
  say "bench/: SKIP (no Redis)"
fi
