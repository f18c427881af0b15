package main

import (
	"slices"
	"strings"
	"testing"

	"github.com/fencekit/fencekit/internal/testenv"
)

// secret is the password every case passes; no output may contain it.
const secret = "Pw-s3cr3t-42"

// TestNoSecretInOutput passes a password through every backend's connection
// flag and the credential environment variables, runs each error path that
// echoes a connection string (unreachable server, a string that does not
// parse, a wrong password at a real server, help and flag mistakes), and
// greps everything printed for the password. Each case also names what its
// output must say, so a case that prints nothing cannot pass.
func TestNoSecretInOutput(t *testing.T) {
	pgHostPort := strings.TrimPrefix(testenv.PostgresURL(), "postgres://")
	if at := strings.LastIndex(pgHostPort, "@"); at >= 0 {
		pgHostPort = pgHostPort[at+1:]
	}
	pgHostPort, _, _ = strings.Cut(pgHostPort, "/")
	redisAddr := testenv.RedisAddr()
	cases := []struct {
		name string
		env  map[string]string
		args []string
		code int
		want string
	}{
		{"postgres URL, unreachable", nil,
			[]string{"demo", "-backend", "postgres", "-postgres-url", "postgres://u:" + secret + "@127.0.0.1:1/test?connect_timeout=2"}, 1, "postgres at postgres://u:xxxxx@127.0.0.1:1"},
		{"postgres URL, unreachable, inspect", nil,
			[]string{"inspect", "-backend", "postgres", "-postgres-url=postgres://u:" + secret + "@127.0.0.1:1/test?connect_timeout=2", "job"}, 1, "postgres at"},
		{"postgres URL, bad port", nil,
			[]string{"demo", "-backend", "postgres", "-postgres-url", "postgres://u:" + secret + "@127.0.0.1:notaport/test"}, 2, "does not parse"},
		{"postgres URL, bad escape", nil,
			[]string{"bump", "-backend", "postgres", "-postgres-url", "postgres://u:" + secret + "%zz@127.0.0.1:5432/test", "job", "-to", "3"}, 2, "does not parse"},
		{"postgres URL, wrong database at the real server", nil,
			[]string{"inspect", "-backend", "postgres", "-postgres-url", "postgres://nobody:" + secret + "@" + pgHostPort + "/no_such_db?sslmode=disable", "job"}, 1, "postgres at"},
		{"postgres keyword DSN, unreachable", nil,
			[]string{"demo", "-backend", "postgres", "-postgres-url", "host=127.0.0.1 port=1 user=u password=" + secret + " dbname=test connect_timeout=2"}, 1, "password=xxxxx"},
		{"postgres keyword DSN, quoted, does not parse", nil,
			[]string{"demo", "-backend", "postgres", "-postgres-url", "host=127.0.0.1 port=notaport password='" + secret + "'"}, 2, "does not parse"},
		{"postgres keyword DSN, backslash-escaped space, unreachable", nil,
			[]string{"inspect", "-backend", "postgres", "-postgres-url", `host=127.0.0.1 port=1 user=u password=Pw\ ` + secret + " connect_timeout=2", "job"}, 1, "password=xxxxx connect_timeout=2"},
		{"postgres PGPASSWORD, unreachable", map[string]string{"PGPASSWORD": secret},
			[]string{"inspect", "-backend", "postgres", "-postgres-url", "postgres://u@127.0.0.1:1/test?connect_timeout=2", "job"}, 1, "postgres at"},
		{"mysql DSN, unreachable", nil,
			[]string{"demo", "-backend", "mysql", "-mysql-dsn", "u:" + secret + "@tcp(127.0.0.1:1)/test"}, 1, "mysql at u:xxxxx@tcp(127.0.0.1:1)/test"},
		{"mysql DSN, bad parameter", nil,
			[]string{"inspect", "-backend", "mysql", "-mysql-dsn", "u:" + secret + "@tcp(127.0.0.1:1)/test?timeout=forever", "job"}, 2, "does not parse"},
		{"mysql DSN, wrong password at the real server", nil,
			[]string{"bump", "-backend", "mysql", "-mysql-dsn", "fencekit:" + secret + "@tcp(127.0.0.1:3306)/test", "job", "-to", "3"}, 1, "mysql at fencekit:xxxxx@"},
		{"redis URL, unreachable", nil,
			[]string{"demo", "-backend", "redis", "-redis-url", "redis://user:" + secret + "@127.0.0.1:1/0"}, 1, "redis at redis://user:xxxxx@127.0.0.1:1/0"},
		{"redis URL, bad database", nil,
			[]string{"inspect", "-backend", "redis", "-redis-url", "redis://:" + secret + "@127.0.0.1:6379/notadb", "job"}, 2, "does not parse"},
		{"redis URL, wrong password at the real server", nil,
			[]string{"inspect", "-backend", "redis", "-redis-url", "redis://nobody:" + secret + "@" + redisAddr + "/0", "job"}, 1, "redis at"},
		{"REDIS_PASSWORD at the real server", map[string]string{"REDIS_PASSWORD": secret},
			[]string{"inspect", "-backend", "redis", "-redis-addr", redisAddr, "job"}, 1, "no lock named"},
		{"REDIS_PASSWORD, unreachable", map[string]string{"REDIS_PASSWORD": secret},
			[]string{"inspect", "-backend", "redis", "-redis-addr", "127.0.0.1:1", "job"}, 1, "redis at 127.0.0.1:1"},
		{"s3 secret key, unreachable", map[string]string{"AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": secret},
			[]string{"inspect", "-backend", "s3", "-s3-endpoint", "http://127.0.0.1:1", "-s3-bucket", "b", "job"}, 1, `s3 bucket "b" at http://127.0.0.1:1`},
		{"s3 endpoint with credentials in it", map[string]string{"AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "other"},
			[]string{"inspect", "-backend", "s3", "-s3-endpoint", "http://k:" + secret + "@127.0.0.1:1", "-s3-bucket", "b", "job"}, 1, "http://k:xxxxx@127.0.0.1:1"},
		{"s3 endpoint that is not a URL", nil,
			[]string{"demo", "-backend", "s3", "-s3-endpoint", "k:" + secret + "@127.0.0.1", "-s3-bucket", "b"}, 2, "is not a URL"},
		{"etcd password, unreachable", map[string]string{"ETCDCTL_USERNAME": "root", "ETCDCTL_PASSWORD": secret},
			[]string{"inspect", "-backend", "etcd", "-etcd-endpoints", "http://127.0.0.1:1", "job"}, 1, "http://127.0.0.1:1: TCP connect failed"},
		{"etcd endpoint with credentials in it", nil,
			[]string{"inspect", "-backend", "etcd", "-etcd-endpoints", "http://root:" + secret + "@127.0.0.1:1", "job"}, 1, "TCP connect failed"},
		{"nats URL with a password, unreachable", nil,
			[]string{"inspect", "-backend", "nats", "-nats-url", "nats://u:" + secret + "@127.0.0.1:1", "job"}, 1, "nats at nats://u:xxxxx@127.0.0.1:1"},
		{"nats URL with a token, unreachable", nil,
			[]string{"inspect", "-backend", "nats", "-nats-url", "nats://" + secret + "@127.0.0.1:1", "job"}, 1, "nats at nats://xxxxx@127.0.0.1:1"},
		{"nats URL with a token, no scheme, unreachable", nil,
			[]string{"demo", "-backend", "nats", "-nats-url=" + secret + "@127.0.0.1:1"}, 1, "nats at xxxxx@127.0.0.1:1"},
		{"NATS_PASSWORD, unreachable", map[string]string{"NATS_USER": "u", "NATS_PASSWORD": secret},
			[]string{"inspect", "-backend", "nats", "-nats-url", "nats://127.0.0.1:1", "job"}, 1, "nats at nats://127.0.0.1:1"},
		{"help with a password on the line", nil,
			[]string{"demo", "-postgres-url", "postgres://u:" + secret + "@h/db", "-h"}, 0, "Usage: fence demo"},
		{"a flag mistake after a password", nil,
			[]string{"inspect", "-mysql-dsn=u:" + secret + "@tcp(h)/db", "-nope", "job"}, 2, "flag provided but not defined"},
		{"a stray argument that is a password", nil,
			[]string{"demo", "-backend", "redis", "redis://:" + secret + "@h:1"}, 2, "unexpected arguments"},
		{"demo help shows the default DSN's password redacted", nil,
			[]string{"help", "demo"}, 0, "fencekit:xxxxx@tcp(127.0.0.1:3306)/test"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			for k, v := range c.env {
				t.Setenv(k, v)
			}
			code, out := fenceCmd(c.args...)
			if code != c.code || !strings.Contains(out, c.want) {
				t.Errorf("fence %q: exit %d, want %d with %q:\n%s", c.args, code, c.code, c.want, out)
			}
			if strings.Contains(out, secret) || strings.Contains(out, "s3cr3t") {
				t.Errorf("fence %q printed the password:\n%s", c.args, out)
			}
			if strings.Contains(out, "fencekit:fencekit") {
				t.Errorf("fence %q printed the default DSN's password:\n%s", c.args, out)
			}
		})
	}
}

func TestRedactConn(t *testing.T) {
	for in, want := range map[string]string{
		"postgres://u:pw@h:5432/db?sslmode=disable": "postgres://u:xxxxx@h:5432/db?sslmode=disable",
		"postgres://u@h/db":                         "postgres://u@h/db",
		"host=h password=pw user=u":                 "host=h password=xxxxx user=u",
		"host=h password='p w' user=u":              "host=h password=xxxxx user=u",
		"u:pw@tcp(h:3306)/db":                       "u:xxxxx@tcp(h:3306)/db",
		"u:p@ss/w@tcp(h:3306)/db":                   "u:xxxxx@tcp(h:3306)/db",
		"u@tcp(h:3306)/db":                          "u@tcp(h:3306)/db",
		"redis://:pw@h:6379/0":                      "redis://:xxxxx@h:6379/0",
		"postgres://u:pw@h:bad/db":                  "postgres://u:xxxxx@h:bad/db",
		"k:pw@h":                                    "k:xxxxx@h",
	} {
		if got := redactConn(in); got != want || strings.Contains(got, "pw") {
			t.Errorf("redactConn(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestNoSecretWithURLDelimiters: a password with an unescaped '@', '#', '/'
// or '?' in a URL makes the URL parse to another host, path or fragment, and
// libraries then print pieces of the password as a host name or a database.
// Every URL flag refuses such a URL as a usage error, before any connection,
// printing no piece of the password, and the rest of the output is not
// garbled by a piece of the password taken for a secret.
func TestNoSecretWithURLDelimiters(t *testing.T) {
	// A URL parser reads "p" as the password: taken for a secret, it would
	// blank every p of the output.
	const pw = "p@Kv7#Wm4/Tn6?Rx5"
	pieces := []string{"Kv7", "Wm4", "Tn6", "Rx5"}
	t.Setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "other")
	for _, args := range [][]string{
		{"inspect", "-backend", "postgres", "-postgres-url", "postgres://u:" + pw + "@127.0.0.1:1/test?connect_timeout=2", "job"},
		{"demo", "-backend", "postgres", "-postgres-url", "postgresql://u:" + pw + "@127.0.0.1:1/test?connect_timeout=2"},
		{"inspect", "-backend", "redis", "-redis-url", "redis://u:" + pw + "@127.0.0.1:1/0", "job"},
		{"bump", "-backend", "redis", "-redis-url", "rediss://:" + pw + "@127.0.0.1:1/0", "job", "-to", "5"},
		{"inspect", "-backend", "etcd", "-etcd-endpoints", "http://root:" + pw + "@127.0.0.1:1", "job"},
		{"inspect", "-backend", "s3", "-s3-endpoint", "http://k:" + pw + "@127.0.0.1:1", "-s3-bucket", "b", "job"},
	} {
		code, out := fenceCmd(args...)
		if code != 2 || !strings.Contains(out, "percent-encode") || !strings.Contains(out, "fence "+args[0]+": ") {
			t.Errorf("fence %q: exit %d, want 2 with a percent-encode hint:\n%s", args, code, out)
		}
		var shown []string
		for _, p := range pieces {
			if strings.Contains(out, p) {
				shown = append(shown, p)
			}
		}
		if shown != nil {
			t.Errorf("fence %q printed %q, pieces of the password", args, shown)
		}
	}
}

// TestBenchChildCommandLineHoldsNoSecret: fence bench -processes starts child
// processes of itself; their command line is readable by every user of the
// machine (ps, /proc/PID/cmdline), so it may carry no connection string's
// password.
func TestBenchChildCommandLineHoldsNoSecret(t *testing.T) {
	bc := backendConfig{
		name:        "postgres",
		postgresURL: "postgres://u:" + secret + "@127.0.0.1:5432/test",
		mysqlDSN:    "u:" + secret + "@tcp(127.0.0.1:3306)/test",
		redisAddr:   "127.0.0.1:6379",
		redisURL:    "redis://:" + secret + "@127.0.0.1:6379/0",
	}
	if line := strings.Join(bc.args(), " "); strings.Contains(line, secret) {
		t.Errorf("a bench child's command line holds the password: %s", line)
	}
	// The child gets them from its environment, and redacts them too.
	k, v, _ := strings.Cut(bc.env(), "=")
	t.Setenv(k, v)
	flags, err := childBackendFlags()
	if err != nil || !slices.Contains(flags, bc.postgresURL) || !slices.Contains(flags, bc.mysqlDSN) || !slices.Contains(flags, bc.redisURL) {
		t.Errorf("a child reads back %q, %v", flags, err)
	}
	if got := newRedactor(nil).redact(bc.postgresURL + " " + bc.mysqlDSN + " " + bc.redisURL); strings.Contains(got, secret) {
		t.Errorf("a child's redactor misses the passwords of its environment: %s", got)
	}
}
