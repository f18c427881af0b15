package main

import (
	"bytes"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// oldNATSAddr is where a NATS Server older than 2.11 (2.9) may run beside
// the tests.
const oldNATSAddr = "nats://127.0.0.1:4222"

// TestDemoOnOldNATSNamesVersions: fence demo -backend nats against a server
// without per-key TTLs fails (exit 1) with an error that names the server's
// version and the one natsfence needs, not only JetStream's "limit marker
// TTLs not supported by server".
func TestDemoOnOldNATSNamesVersions(t *testing.T) {
	nc, err := nats.Connect(oldNATSAddr, nats.Timeout(2*time.Second))
	if errors.Is(err, nats.ErrNoServers) {
		t.Skipf("no NATS server at %s (%v): this test needs one older than %s there", oldNATSAddr, err, natsMinServer)
	}
	if err != nil {
		t.Fatalf("connect to %s: %v", oldNATSAddr, err)
	}
	version := nc.ConnectedServerVersion()
	nc.Close()
	if !natsOlderThan(version, natsMinServer) {
		t.Skipf("the NATS server at %s is %s, not older than %s: the demo would run on it", oldNATSAddr, version, natsMinServer)
	}
	var out, errOut bytes.Buffer
	code := run([]string{"demo", "-backend", "nats", "-nats-url", oldNATSAddr}, &out, &errOut)
	msg := errOut.String()
	if code != 1 {
		t.Errorf("exit %d, want 1\nstdout:\n%s\nstderr:\n%s", code, out.String(), msg)
	}
	for _, want := range []string{"fence demo: nats bucket ", "NATS Server " + version + ",", "need " + natsMinServer + " or later", "limit marker TTLs not supported by server"} {
		if !strings.Contains(msg, want) {
			t.Errorf("stderr lacks %q:\n%s", want, msg)
		}
	}
}

// natsOlderThan reports whether the server version v (such as "2.9.10") is
// older than min (such as "2.11").
func natsOlderThan(v, min string) bool {
	a, b := strings.Split(v, "."), strings.Split(min, ".")
	for i := range b {
		if i >= len(a) {
			return true
		}
		x, _ := strconv.Atoi(strings.SplitN(a[i], "-", 2)[0])
		y, _ := strconv.Atoi(b[i])
		if x != y {
			return x < y
		}
	}
	return false
}
