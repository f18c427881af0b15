#!/usr/bin/env bash
# Module hygiene, run by scripts/test.sh: go mod tidy changes nothing (both
# modules), gofmt changes nothing, staticcheck finds nothing, and govulncheck finds no vulnerable
# function of a required module that the code calls.
#
# govulncheck reads its database from golang.org/x/vulndb, a module fetched
# through the Go module proxy like any other and indexed locally with the
# vulndb's own indexdb command, so it runs where only the proxy is reachable.
# Vulnerabilities of the Go standard library are reported, not failed on: the
# Go release on the machine fixes them, not this module.
#
# Without the tools (no proxy), each check skips with the reason, or fails when
# CI is set.
set -euo pipefail
cd "$(dirname "$0")/.."

STATICCHECK=honnef.co/go/tools/cmd/staticcheck@v0.8.2
GOVULNCHECK=golang.org/x/vuln/cmd/govulncheck@v1.9.0
VULNDB=v0.0.0-20261105234957-e22db6528018

say() { printf 'hygiene.sh: %s\n' "$*" >&2; }
unavailable() {
  if [ -n "${CI:-}" ]; then say "FAIL: $*"; exit 1; fi
  say "SKIP: $*"
}

status=0
for m in . bench; do
  if ! out=$(cd "$m" && go mod tidy -diff 2>&1); then
    say "go mod tidy would change $m/go.mod or $m/go.sum:"; printf '%s\n' "$out" >&2; status=1
  fi
done

if out=$(gofmt -l . 2>&1) && [ -n "$out" ]; then
  say "gofmt would change:"; printf '%s\n' "$out" >&2; status=1
fi

say "staticcheck ./... (and the bench module)"
if go run "$STATICCHECK" -version >/dev/null 2>&1; then
  go run "$STATICCHECK" ./... || status=1
  (cd bench && go run "$STATICCHECK" ./...) || status=1
else
  unavailable "staticcheck ($STATICCHECK) could not be fetched"
fi

say "govulncheck ./..."
db="${XDG_CACHE_HOME:-$HOME/.cache}/fencekit/vulndb-$VULNDB"
if [ ! -f "$db/index/db.json" ]; then
  if src=$(go mod download -json "golang.org/x/vulndb@$VULNDB" 2>/dev/null | sed -n 's/.*"Dir": "\(.*\)".*/\1/p') && [ -n "$src" ]; then
    rm -rf "$db.tmp" && mkdir -p "$(dirname "$db")"
    go run "golang.org/x/vulndb/cmd/indexdb@$VULNDB" -vulns "$src/data/osv" -out "$db.tmp" && rm -rf "$db" && mv "$db.tmp" "$db"
  fi
fi
if [ -f "$db/index/db.json" ] && go run "$GOVULNCHECK" -version >/dev/null 2>&1; then
  go run "$GOVULNCHECK" -db "file://$db" -format json ./... | go run ./scripts/vulnfilter || status=1
else
  unavailable "govulncheck or its database (golang.org/x/vulndb@$VULNDB) could not be fetched"
fi
exit $status
