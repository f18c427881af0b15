#!/usr/bin/env bash
# fencekit against bsm/redislock and go-redsync/redsync: the lesson's locked
# increments on the same Redis server in one run (see bench/peers_test.go).
# BENCH_ROUNDS, BENCH_WORKERS and BENCH_EACH size it; FENCEKIT_REDIS_ADDR picks the server.
set -euo pipefail
cd "$(dirname "$0")/../bench"
go test -run XXX -bench Peers -benchtime 1x -timeout 30m .
