package main

import (
	"bytes"
	"errors"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/fencekit/fencekit/internal/testenv"
)

func TestDemo(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("the demo replays the lesson's timings (about 7s); skipped with -short")
	}
	var out, errOut bytes.Buffer
	db := filepath.Join(t.TempDir(), "demo.db")
	code := run([]string{"demo", "-db", db}, &out, &errOut)
	if code != 0 {
		t.Fatalf("fence demo exited %d\nstdout:\n%s\nstderr:\n%s", code, out.String(), errOut.String())
	}
	for _, want := range []string{
		"C acquires while B still works -> true",
		"A's release -> lease lost; C acquires while B still works -> false",
		"20 workers x 50 locked increments -> balance 1000",
		`final value: "written by A"`,
		`final value: "written by B"`,
		"charges at the provider: 1",
		"charges at the provider after the 5xx and its retries: 1",
		"Every outcome was the expected one.",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("demo output lacks %q\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "FAIL") {
		t.Errorf("demo output has a failed outcome:\n%s", out.String())
	}
	checkStaleRejected(t, out.String())
	// A second run on the kept database: tokens continue, the outcomes hold.
	out.Reset()
	if code := run([]string{"demo", "-db", db}, &out, &errOut); code != 0 {
		t.Fatalf("second fence demo on the kept database exited %d\n%s%s", code, out.String(), errOut.String())
	}
}

func TestDemoPostgres(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("the demo replays the lesson's timings (about 7s); skipped with -short")
	}
	url := testenv.PostgresURL()
	if err := testenv.PingPostgres(url); err != nil {
		testenv.Missing(t, "PostgreSQL at "+url, err)
	}
	var out, errOut bytes.Buffer
	if code := run([]string{"demo", "-backend", "postgres", "-postgres-url", url}, &out, &errOut); code != 0 {
		t.Fatalf("fence demo -backend postgres exited %d\n%s%s", code, out.String(), errOut.String())
	}
	for _, want := range []string{"fence demo on postgres", `storage: REJECTED  "written by A"`, "Every outcome was the expected one."} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("demo output lacks %q\n%s", want, out.String())
		}
	}
}

func TestDemoMySQL(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("the demo replays the lesson's timings (about 7s); skipped with -short")
	}
	dsn := testenv.MySQLDSN()
	var out, errOut bytes.Buffer
	code := run([]string{"demo", "-backend", "mysql", "-mysql-dsn", dsn}, &out, &errOut)
	if code != 0 && strings.Contains(errOut.String(), "mysql at") {
		testenv.Missing(t, "MySQL or MariaDB at "+dsn, errors.New(errOut.String()))
	}
	if code != 0 {
		t.Fatalf("fence demo -backend mysql exited %d\n%s%s", code, out.String(), errOut.String())
	}
	for _, want := range []string{"fence demo on mysql", `storage: REJECTED  "written by A"`, "Every outcome was the expected one."} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("demo output lacks %q\n%s", want, out.String())
		}
	}
}

func TestDemoRedis(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("the demo replays the lesson's timings (about 7s); skipped with -short")
	}
	if err := testenv.Dial(testenv.RedisAddr()); err != nil {
		testenv.Missing(t, "Redis at "+testenv.RedisAddr(), err)
	}
	var out, errOut bytes.Buffer
	if code := run([]string{"demo", "-backend", "redis", "-redis-addr", testenv.RedisAddr()}, &out, &errOut); code != 0 {
		t.Fatalf("fence demo -backend redis exited %d\n%s%s", code, out.String(), errOut.String())
	}
	for _, want := range []string{"fence demo on redis", `storage: REJECTED  "written by A"`, "Every outcome was the expected one."} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("demo output lacks %q\n%s", want, out.String())
		}
	}
}

func TestDemoEtcd(t *testing.T) {
	if testing.Short() {
		t.Skip("the etcd demo stretches the lesson's timings to whole-second leases (about 35s); skipped with -short")
	}
	var out, errOut bytes.Buffer
	if code := run([]string{"demo", "-backend", "etcd"}, &out, &errOut); code != 0 {
		t.Fatalf("fence demo -backend etcd exited %d\n%s%s", code, out.String(), errOut.String())
	}
	for _, want := range []string{"fence demo on embedded etcd", `storage: REJECTED  "written by A"`, "Every outcome was the expected one."} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("demo output lacks %q\n%s", want, out.String())
		}
	}
}

func TestDemoNATS(t *testing.T) {
	t.Parallel() // an in-process server of its own
	if testing.Short() {
		t.Skip("the NATS demo stretches the lesson's timings to whole-second leases (about 30s); skipped with -short")
	}
	var out, errOut bytes.Buffer
	if code := run([]string{"demo", "-backend", "nats"}, &out, &errOut); code != 0 {
		t.Fatalf("fence demo -backend nats exited %d\n%s%s", code, out.String(), errOut.String())
	}
	for _, want := range []string{"fence demo on in-process nats", `storage: REJECTED  "written by A"`, "Every outcome was the expected one."} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("demo output lacks %q\n%s", want, out.String())
		}
	}
}

func TestDemoS3(t *testing.T) {
	t.Parallel() // an in-process server of its own
	if testing.Short() {
		t.Skip("the demo replays the lesson's timings (about a minute: S3 leases of whole seconds, and Dates up to DateLag old); skipped with -short")
	}
	var out, errOut bytes.Buffer
	if code := run([]string{"demo", "-backend", "s3"}, &out, &errOut); code != 0 {
		t.Fatalf("fence demo -backend s3 exited %d\n%s%s", code, out.String(), errOut.String())
	}
	for _, want := range []string{"fence demo on in-process S3", `storage: REJECTED  "written by A"`, "Every outcome was the expected one."} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("demo output lacks %q\n%s", want, out.String())
		}
	}
}

func TestDemoGCS(t *testing.T) {
	t.Parallel() // an in-process server of its own
	if testing.Short() {
		t.Skip("the demo replays the lesson's timings (about 10s); skipped with -short")
	}
	var out, errOut bytes.Buffer
	if code := run([]string{"demo", "-backend", "gcs"}, &out, &errOut); code != 0 {
		t.Fatalf("fence demo -backend gcs exited %d\n%s%s", code, out.String(), errOut.String())
	}
	for _, want := range []string{"fence demo on in-process GCS", `storage: REJECTED  "written by A"`, "Every outcome was the expected one."} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("demo output lacks %q\n%s", want, out.String())
		}
	}
}

func TestUsage(t *testing.T) {
	cases := []struct {
		args []string
		code int
		want string
	}{
		{nil, 2, "Usage:"},
		{[]string{"help"}, 0, "fence demo"},
		{[]string{"-h"}, 0, "fence demo"},
		{[]string{"help", "demo"}, 0, "Usage: fence demo"},
		{[]string{"help", "nope"}, 2, `unknown command "nope"`},
		{[]string{"help", "inspect", "extra"}, 2, `unexpected arguments ["extra"]`},
		{[]string{"nope"}, 2, `unknown command "nope"`},
		{[]string{"demo", "-h"}, 0, "Usage: fence demo"},
		{[]string{"demo", "-backend", "nope"}, 2, `unknown backend "nope"`},
		{[]string{"demo", "extra"}, 2, "unexpected arguments"},
		{[]string{"demo", "-nope"}, 2, "flag provided but not defined"},
		{[]string{"bench", "-n", "0"}, 2, "must be at least 1"},
		{[]string{"demo", "-backend", "postgres", "-postgres-url", "postgres://nobody@127.0.0.1:1/none?connect_timeout=2"}, 1, "postgres at"},
		{[]string{"demo", "-backend", "postgres", "-postgres-url", "postgres://nobody@127.0.0.1:notaport/none"}, 2, "does not parse"},
		{[]string{"demo", "-backend", "mysql", "-mysql-dsn", "nobody@127.0.0.1:3306/test"}, 2, "does not parse"},
		{[]string{"demo", "-backend", "redis", "-redis-url", "http://127.0.0.1:6379"}, 2, "does not parse"},
		{[]string{"demo", "-backend", "s3", "-s3-endpoint", "127.0.0.1:9000", "-s3-bucket", "b"}, 2, "is not a URL"},
		{[]string{"demo", "-backend", "redis", "-redis-addr", "127.0.0.1:1"}, 1, "redis at"},
		{[]string{"demo", "-backend", "azure", "-azure-url", "http://127.0.0.1:1/acct/"}, 2, "-azure-url needs -azure-container"},
		{[]string{"demo", "-backend", "azure", "-azure-url", "127.0.0.1:10000", "-azure-container", "c"}, 2, "is not a URL"},
	}
	for _, c := range cases {
		var out, errOut bytes.Buffer
		code := run(c.args, &out, &errOut)
		all := out.String() + errOut.String()
		if code != c.code || !strings.Contains(all, c.want) {
			t.Errorf("fence %q: exit %d, want %d; output lacks %q?\n%s", c.args, code, c.code, c.want, all)
		}
		// Help asked for goes to stdout; a mistake and its usage to stderr.
		if code == 0 && (out.Len() == 0 || errOut.Len() > 0) {
			t.Errorf("fence %q: exit 0 with stdout %q and stderr %q: help belongs on stdout", c.args, out.String(), errOut.String())
		}
		if code == 2 && (errOut.Len() == 0 || out.Len() > 0) {
			t.Errorf("fence %q: exit 2 with stdout %q and stderr %q: a usage error belongs on stderr", c.args, out.String(), errOut.String())
		}
	}
}

// TestOperatorHelp: inspect's and bump's help shows no default backend to act
// on, the demo's does.
func TestOperatorHelp(t *testing.T) {
	for _, cmd := range []string{"inspect", "bump"} {
		var out, errOut bytes.Buffer
		if code := run([]string{cmd, "-h"}, &out, &errOut); code != 0 {
			t.Fatalf("fence %s -h: exit %d\n%s", cmd, code, errOut.String())
		}
		_, flags, _ := strings.Cut(out.String(), "Flags:")
		flags = strings.ReplaceAll(flags, `(default "sqlite")`, "")
		for _, bad := range []string{"temporary", "embedded", "in-process", "127.0.0.1", "(default \""} {
			if strings.Contains(flags, bad) {
				t.Errorf("fence %s -h shows %q:\n%s", cmd, bad, out.String())
			}
		}
	}
	var out, errOut bytes.Buffer
	run([]string{"demo", "-h"}, &out, &errOut)
	if !strings.Contains(out.String(), "temporary file") || !strings.Contains(out.String(), "127.0.0.1") {
		t.Errorf("fence demo -h lost its defaults:\n%s", out.String())
	}
}

func TestBench(t *testing.T) {
	var out, errOut bytes.Buffer
	code := run([]string{"bench", "-n", "20", "-rounds", "1", "-workers", "4", "-each", "5"}, &out, &errOut)
	if code != 0 {
		t.Fatalf("fence bench exited %d\n%s%s", code, out.String(), errOut.String())
	}
	for _, want := range []string{"fenced write", "plain write of the same size (baseline)", "4 workers x 5 locked increments -> 20 each time"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("bench output lacks %q\n%s", want, out.String())
		}
	}
}

func TestBenchRedis(t *testing.T) {
	if err := testenv.Dial(testenv.RedisAddr()); err != nil {
		testenv.Missing(t, "Redis at "+testenv.RedisAddr(), err)
	}
	var out, errOut bytes.Buffer
	code := run([]string{"bench", "-backend", "redis", "-redis-addr", testenv.RedisAddr(), "-n", "20", "-rounds", "1",
		"-workers", "4", "-each", "5", "-exercise-each", "5"}, &out, &errOut)
	if code != 0 {
		t.Fatalf("fence bench -backend redis exited %d\n%s%s", code, out.String(), errOut.String())
	}
	for _, want := range []string{"round-trip floor", "exercise, 4 workers x 5 updates"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("bench output lacks %q\n%s", want, out.String())
		}
	}
}

// staleLine is scene 3's rejected write: A's token, then the larger one the
// key holds (tokens start at the backend's clock in microseconds, so their
// values differ from run to run; their order does not).
var staleLine = regexp.MustCompile(`storage: REJECTED  "written by A" token (\d+) \(the key already holds token (\d+)\)`)

// checkStaleRejected asserts that the demo shows A's write rejected with a
// token below B's, in the storage log and on the timeline.
func checkStaleRejected(t *testing.T, out string) {
	t.Helper()
	m := staleLine.FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("demo output lacks A's rejected write (%s)\n%s", staleLine, out)
	}
	a, _ := strconv.ParseUint(m[1], 10, 64)
	b, _ := strconv.ParseUint(m[2], 10, 64)
	if a == 0 || a >= b {
		t.Errorf("A's rejected token %d is not below the key's %d", a, b)
	}
	if !strings.Contains(out, "W REJECTED (token "+m[1]+")") {
		t.Errorf("the timeline lacks A's rejected write with token %s\n%s", m[1], out)
	}
}

func TestBenchSweep(t *testing.T) {
	if err := testenv.Dial(testenv.RedisAddr()); err != nil {
		testenv.Missing(t, "Redis at "+testenv.RedisAddr(), err)
	}
	var out, errOut bytes.Buffer
	code := run([]string{"bench", "-backend", "redis", "-redis-addr", testenv.RedisAddr(), "-sweep",
		"-points", "1x2,2x2", "-rounds", "1", "-increments", "12"}, &out, &errOut)
	if code != 0 {
		t.Fatalf("fence bench -sweep exited %d\n%s%s", code, out.String(), errOut.String())
	}
	// One row per point, each run exact (the sweep fails on a lost update),
	// with its commands and waits: 12 increments per run.
	row := regexp.MustCompile(`(?m)^\s+(1x2|2x2)\s+12\s+fencekit\s+\S+\s+\S+\s+-\s+([0-9.]+)\s+([0-9.]+)\s+\S+\s+\S+\s+\S+\s+\S+\s*$`)
	rows := row.FindAllStringSubmatch(out.String(), -1)
	if len(rows) != 2 || rows[0][1] != "1x2" || rows[1][1] != "2x2" {
		t.Fatalf("want a fencekit row for 1x2 and for 2x2:\n%s", out.String())
	}
	for _, r := range rows {
		// Each increment sends at least its GET and SET and one release.
		if sent, _ := strconv.ParseFloat(r[2], 64); sent < 3 {
			t.Errorf("%s: %v commands sent per increment, want at least 3\n%s", r[1], sent, out.String())
		}
	}
	if !strings.Contains(out.String(), "cd bench && go run ./sweep -points 1x2,2x2") {
		t.Errorf("the sweep does not say how to run the peers:\n%s", out.String())
	}
	code = run([]string{"bench", "-backend", "sqlite", "-sweep"}, &out, &errOut)
	if code != 2 {
		t.Errorf("-sweep on sqlite exited %d, want 2 (usage)", code)
	}
	code = run([]string{"bench", "-backend", "redis", "-redis-addr", testenv.RedisAddr(), "-sweep", "-points", "4y5"}, &out, &errOut)
	if code != 2 {
		t.Errorf("-points 4y5 exited %d, want 2 (usage)", code)
	}
}

// TestBenchPeers: on PostgreSQL and MySQL, fence bench also measures the
// server's own lock on the same workload, and its increments end exact.
func TestBenchPeers(t *testing.T) {
	for _, c := range []struct {
		backend, flag, url, peer string
	}{
		{"postgres", "-postgres-url", testenv.PostgresURL(), "pg_advisory_lock"},
		{"mysql", "-mysql-dsn", testenv.MySQLDSN(), "GET_LOCK"},
	} {
		t.Run(c.backend, func(t *testing.T) {
			if c.backend == "postgres" {
				if err := testenv.PingPostgres(c.url); err != nil {
					testenv.Missing(t, "PostgreSQL at "+c.url, err)
				}
			}
			var out, errOut bytes.Buffer
			code := run([]string{"bench", "-backend", c.backend, c.flag, c.url, "-n", "20", "-rounds", "1", "-workers", "4", "-each", "5"}, &out, &errOut)
			if code != 0 && c.backend == "mysql" && strings.Contains(errOut.String(), "mysql at") {
				testenv.Missing(t, "MySQL or MariaDB at "+c.url, errors.New(errOut.String()))
			}
			if code != 0 {
				t.Fatalf("fence bench -backend %s exited %d\n%s%s", c.backend, code, out.String(), errOut.String())
			}
			for _, want := range []string{"against the server's own lock (" + c.peer, "uncontended lock + unlock: ", "4 workers x 5 increments under its lock"} {
				if !strings.Contains(out.String(), want) {
					t.Errorf("bench output lacks %q\n%s", want, out.String())
				}
			}
		})
	}
}
