package main

import (
	"bytes"
	"flag"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
)

// checkUsageError asserts that fence args exits 2 having printed nothing on
// stdout, and on stderr a first line "fence CMD: ..." holding want, with the
// command's prefix once: no "fence: " or "usage: " of an inner error after it.
func checkUsageError(t *testing.T, args []string, want string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := run(args, &out, &errOut)
	first, _, _ := strings.Cut(errOut.String(), "\n")
	prefix := "fence " + args[0] + ": "
	if code != 2 || out.Len() > 0 {
		t.Errorf("fence %q: exit %d with stdout %q, want 2 and nothing on stdout\n%s", args, code, out.String(), errOut.String())
	}
	rest, ok := strings.CutPrefix(first, prefix)
	if !ok || !strings.Contains(first, want) {
		t.Errorf("fence %q: first line %q, want %q...%q", args, first, prefix, want)
	}
	for _, again := range []string{"fence:", "fence " + args[0] + ":", "usage:"} {
		if strings.Contains(rest, again) {
			t.Errorf("fence %q: the first line repeats a prefix (%q): %q", args, again, first)
		}
	}
}

// TestBadUsageExitsTwoWithOnePrefix: an unknown flag, a missing or extra
// argument, an unknown backend, and a lock name or key the backend refuses are
// bad usage: exit status 2, and one line that names the command once.
func TestBadUsageExitsTwoWithOnePrefix(t *testing.T) {
	path, a := sqliteLocks(t)
	grantOnce(t, a, "job")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"demo", "-nope"}, "flag provided but not defined: -nope"},
		{[]string{"bench", "-nope"}, "flag provided but not defined: -nope"},
		{[]string{"inspect", "-nope", "job"}, "flag provided but not defined: -nope"},
		{[]string{"bump", "-nope", "job"}, "flag provided but not defined: -nope"},
		{[]string{"demo", "extra"}, `unexpected arguments ["extra"]`},
		{[]string{"demo", "-backend", "nope"}, `unknown backend "nope"`},
		{[]string{"inspect", "-backend", "nope", "job"}, `unknown backend "nope"`},
		{[]string{"inspect", "-db", path}, "missing the lock NAME"},
		{[]string{"bump", "-db", path, "-to", "5"}, "missing the lock NAME"},
		{[]string{"inspect", "-db", path, "a", "b"}, `want one lock NAME, got 2: ["a" "b"]`},
		{[]string{"bump", "-db", path, "job"}, `-to wants a token in 1..`},
		{[]string{"inspect", "-db", path, ""}, "invalid lock NAME: empty"},
		{[]string{"bump", "-db", path, "-to", "5", ""}, "invalid lock NAME: empty"},
		{[]string{"inspect", "-db", path, "-key", strings.Repeat("k", 1100), "job"}, "invalid -key: 1100 bytes"},
	} {
		checkUsageError(t, c.args, c.want)
	}
}

// TestRefusalKeepsOnePrefix: a backend's refusal (a bump that would lower the
// counter) exits 1, and its line names the command once.
func TestRefusalKeepsOnePrefix(t *testing.T) {
	path, a := sqliteLocks(t)
	grantOnce(t, a, "job")
	var out, errOut bytes.Buffer
	code := run([]string{"bump", "-db", path, "job", "-to", "5"}, &out, &errOut)
	want := regexp.MustCompile(`^fence bump: -to: 5 would not raise the counter, already at [0-9]+\n$`)
	if code != 1 || !want.MatchString(errOut.String()) {
		t.Errorf("bump below the counter: exit %d, stderr %q; want 1 and %s", code, errOut.String(), want)
	}
}

// TestFlagOfAnotherBackendRefused: a backend flag given for another backend
// than -backend names is bad usage, refused before anything is opened or
// started, instead of being ignored.
func TestFlagOfAnotherBackendRefused(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("TMPDIR", dir) // a demo that went ahead would make its SQLite file here
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"demo", "-backend", "sqlite", "-redis-addr", "127.0.0.1:1"}, "-redis-addr is for -backend redis, not -backend sqlite"},
		{[]string{"demo", "-redis-url", "redis://127.0.0.1:1"}, "-redis-url is for -backend redis, not -backend sqlite"},
		{[]string{"demo", "-backend", "postgres", "-db", "x.db"}, "-db is for -backend sqlite or etcd, not -backend postgres"},
		{[]string{"demo", "-backend", "nats", "-s3-bucket", "b"}, "-s3-bucket is for -backend s3, not -backend nats"},
		{[]string{"demo", "-backend", "gcs", "-azure-container", "c"}, "-azure-container is for -backend azure, not -backend gcs"},
		{[]string{"bench", "-backend", "redis", "-sweep", "-mysql-dsn", "u:p@tcp(127.0.0.1:1)/db"}, "-mysql-dsn is for -backend mysql, not -backend redis"},
		{[]string{"bench", "-etcd-endpoints", "http://127.0.0.1:1"}, "-etcd-endpoints is for -backend etcd, not -backend sqlite"},
		{[]string{"inspect", "-backend", "postgres", "-postgres-url", "postgres://127.0.0.1:1/x", "-nats-bucket", "b", "job"}, "-nats-bucket is for -backend nats, not -backend postgres"},
		{[]string{"bump", "-backend", "redis", "-redis-addr", "127.0.0.1:1", "-gcs-endpoint", "http://127.0.0.1:1", "job", "-to", "5"}, "-gcs-endpoint is for -backend gcs, not -backend redis"},
	} {
		checkUsageError(t, c.args, c.want)
	}
	if left, _ := os.ReadDir(dir); len(left) > 0 {
		t.Errorf("a refused command left %v in its temporary directory", left)
	}
}

// TestEveryBackendFlagNamesItsBackends: each flag the backend config
// registers, for the demo and for the operators' commands, says which
// backends it is for, and those are backends the command knows, so that a
// flag added later cannot be silently ignored on another backend.
func TestEveryBackendFlagNamesItsBackends(t *testing.T) {
	for _, operator := range []bool{false, true} {
		fs := flag.NewFlagSet("fence", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		(&backendConfig{}).register(fs, operator)
		fs.VisitAll(func(f *flag.Flag) {
			if f.Name == "backend" {
				return
			}
			owners, ok := flagBackends[f.Name]
			if !ok {
				t.Errorf("-%s (operator %v) is in no flagBackends entry", f.Name, operator)
			}
			for _, b := range owners {
				if !slices.Contains(backendNames, b) {
					t.Errorf("flagBackends[%q] names %q, not a backend", f.Name, b)
				}
			}
		})
	}
}

// TestOperatorKnowsEveryListedBackend: inspect and bump list gcs and azure
// among their backends (-backend's help, the "have:" list of the refusal)
// and take -gcs-* and -azure-* flags. Given a backend that is named in full
// but unreachable, they must try it (exit 1, the backend failed), not refuse
// it as an unknown backend (exit 2) while listing it as known.
func TestOperatorKnowsEveryListedBackend(t *testing.T) {
	t.Setenv("AZURE_STORAGE_ACCOUNT", "devstoreaccount1")
	t.Setenv("AZURE_STORAGE_KEY", "ZmVuY2VraXQtdGVzdC1rZXk=")
	for _, args := range [][]string{
		{"inspect", "-backend", "gcs", "-gcs-endpoint", "http://127.0.0.1:1", "-gcs-bucket", "b", "job"},
		{"bump", "-backend", "gcs", "-gcs-endpoint", "http://127.0.0.1:1", "-gcs-bucket", "b", "-to", "5", "job"},
		{"inspect", "-backend", "azure", "-azure-url", "http://127.0.0.1:1/devstoreaccount1", "-azure-container", "c", "job"},
		{"bump", "-backend", "azure", "-azure-url", "http://127.0.0.1:1/devstoreaccount1", "-azure-container", "c", "-to", "5", "job"},
	} {
		var out, errOut bytes.Buffer
		code := run(args, &out, &errOut)
		if strings.Contains(errOut.String(), "unknown backend") || code == 2 {
			t.Errorf("fence %q: exit %d, stderr %q; want the backend tried (exit 1 for an unreachable one), not refused as unknown", args, code, errOut.String())
		}
	}
}

// TestBackendFlagFormsAndOrder: the refusal of another backend's flag does
// not depend on how the flags are spelled or ordered: a flag given twice,
// the -name=value and --name forms, -backend after the backend flag, a
// later -backend replacing an earlier one, a flag after the NAME. And a
// backend flag with an empty value (-redis-addr=) is still a flag given.
// Passes: covers spellings and orders the suite did not.
func TestBackendFlagFormsAndOrder(t *testing.T) {
	path := filepath.Join(t.TempDir(), "locks.db")
	db, err := sqlfence.OpenSQLite(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"inspect", "-redis-addr", "127.0.0.1:1", "-db", path, "job"}, "-redis-addr is for -backend redis, not -backend sqlite"},
		{[]string{"inspect", "-redis-addr=", "-db", path, "job"}, "-redis-addr is for -backend redis, not -backend sqlite"},
		{[]string{"inspect", "--redis-url=redis://127.0.0.1:1", "--db=" + path, "job"}, "-redis-url is for -backend redis, not -backend sqlite"},
		{[]string{"inspect", "-db", path, "job", "-redis-addr", "127.0.0.1:1"}, "-redis-addr is for -backend redis, not -backend sqlite"},
		{[]string{"inspect", "-db", path, "job", "-backend", "redis"}, "-db is for -backend sqlite or etcd, not -backend redis"},
		{[]string{"inspect", "-redis-addr", "127.0.0.1:1", "-backend", "redis", "-backend", "sqlite", "-db", path, "job"}, "-redis-addr is for -backend redis, not -backend sqlite"},
		{[]string{"bump", "-db", path, "-db", path, "-backend=postgres", "-postgres-url=postgres://127.0.0.1:1/x", "-to", "5", "job"}, "-db is for -backend sqlite or etcd, not -backend postgres"},
		{[]string{"bump", "-db", path, "-to", "5", "-to", "0", "job"}, "-to wants a token in 1.."},
		{[]string{"inspect", "-backend=", "-db", path, "job"}, `unknown backend ""`},
		{[]string{"inspect", "-backend", "SQLite", "-db", path, "job"}, `unknown backend "SQLite"`},
		{[]string{"demo", "-backend", "sqlite", "-nats-url=", "-nats-url=nats://127.0.0.1:1"}, "-nats-url is for -backend nats, not -backend sqlite"},
	} {
		checkUsageError(t, c.args, c.want)
	}
}
