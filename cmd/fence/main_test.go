package main

import (
	"bytes"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fencekit/fencekit/internal/testenv"
)

func TestDemo(t *testing.T) {
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
		`storage: REJECTED  "written by A" token 1 (the key already holds token 2)`,
		`final value: "written by A"`,
		`final value: "written by B"`,
		"charges at the provider: 1",
		"charges at the provider after the 5xx and its retries: 1",
		"W REJECTED (token 1)",
		"Every outcome was the expected one.",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("demo output lacks %q\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "FAIL") {
		t.Errorf("demo output has a failed outcome:\n%s", out.String())
	}
	// A second run on the kept database: tokens continue, the outcomes hold.
	out.Reset()
	if code := run([]string{"demo", "-db", db}, &out, &errOut); code != 0 {
		t.Fatalf("second fence demo on the kept database exited %d\n%s%s", code, out.String(), errOut.String())
	}
}

func TestDemoPostgres(t *testing.T) {
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

func TestDemoS3(t *testing.T) {
	if testing.Short() {
		t.Skip("the demo replays the lesson's timings (about 7s); skipped with -short")
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

func TestInspectAndBump(t *testing.T) {
	db := filepath.Join(t.TempDir(), "locks.db")
	fence := func(args ...string) (int, string) {
		var out, errOut bytes.Buffer
		code := run(args, &out, &errOut)
		return code, out.String() + errOut.String()
	}
	if code, out := fence("inspect", "-db", db, "job"); code != 1 || !strings.Contains(out, `no lock named "job"`) {
		t.Errorf("inspect of an unknown name: %d %s", code, out)
	}
	if code, out := fence("bump", "job", "-db", db, "-to", "40"); code != 0 || !strings.Contains(out, "counter raised to 40") {
		t.Errorf("bump: %d %s", code, out)
	}
	if code, out := fence("bump", "-db", db, "-to", "39", "job"); code != 1 || !strings.Contains(out, "would not raise the counter, already at 40") {
		t.Errorf("bump downwards: %d %s", code, out)
	}
	if code, out := fence("inspect", "-db", db, "-key", "report", "job"); code != 0 || !strings.Contains(out, "counter:   40") || !strings.Contains(out, "held:      no") {
		t.Errorf("inspect after the bump: %d %s", code, out)
	}
	for _, bad := range [][]string{{"bump", "job"}, {"bump", "job", "-to", "0"}, {"inspect"}, {"inspect", "a", "b"}} {
		if code, out := fence(bad...); code != 2 {
			t.Errorf("fence %q: exit %d, want 2\n%s", bad, code, out)
		}
	}
	if code, out := fence("bump", "-backend", "etcd", "job", "-to", "5"); code != 1 || !strings.Contains(out, "no counter to bump") {
		t.Errorf("bump on etcd: %d %s", code, out)
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
		{[]string{"nope"}, 2, `unknown command "nope"`},
		{[]string{"demo", "-h"}, 0, "Usage: fence demo"},
		{[]string{"demo", "-backend", "nope"}, 2, `unknown backend "nope"`},
		{[]string{"demo", "extra"}, 2, "unexpected arguments"},
		{[]string{"demo", "-nope"}, 2, "flag provided but not defined"},
		{[]string{"bench", "-n", "0"}, 2, "must be at least 1"},
		{[]string{"demo", "-backend", "postgres", "-postgres-url", "postgres://nobody@127.0.0.1:1/none?connect_timeout=2"}, 1, "postgres at"},
		{[]string{"demo", "-backend", "redis", "-redis-addr", "127.0.0.1:1"}, 1, "redis at"},
	}
	for _, c := range cases {
		var out, errOut bytes.Buffer
		code := run(c.args, &out, &errOut)
		all := out.String() + errOut.String()
		if code != c.code || !strings.Contains(all, c.want) {
			t.Errorf("fence %q: exit %d, want %d; output lacks %q?\n%s", c.args, code, c.code, c.want, all)
		}
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
