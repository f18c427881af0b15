package testenv

import (
	"go/build"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// VersityVersion is the versitygw release the tests run against; scripts/test.sh
// installs it with go install when it is missing.
const VersityVersion = "v1.8.0"

// S3Server is an S3-compatible endpoint for tests.
type S3Server struct {
	Name                 string // "versitygw", or "external"
	Endpoint             string // http(s)://host:port
	Region               string
	AccessKey, SecretKey string
	// Bucket, when set, is the bucket to use (an external server); otherwise
	// tests create their own.
	Bucket string
	// External: the server was given by FENCEKIT_S3_ENDPOINT; it is not
	// started here and may be remote, so tests that put a fault-injecting
	// proxy in front of it (which changes the Host the request is signed for)
	// do not run.
	External bool
}

// ExternalS3 reports whether FENCEKIT_S3_ENDPOINT names the real S3 server of
// the tests, which RealS3 then returns instead of starting versitygw.
func ExternalS3() bool { return os.Getenv("FENCEKIT_S3_ENDPOINT") != "" }

// RealS3 returns the real S3-compatible server the tests run against: the one
// named by FENCEKIT_S3_ENDPOINT (with FENCEKIT_S3_ACCESS_KEY,
// FENCEKIT_S3_SECRET_KEY, FENCEKIT_S3_REGION and FENCEKIT_S3_BUCKET), for
// example MinIO or AWS; otherwise a versitygw gateway serving a temporary
// folder, started for the test on a free loopback port and stopped after it.
// Without a versitygw binary (on PATH or in GOPATH/bin) the test skips, or
// fails when CI is set.
func RealS3(t testing.TB) *S3Server {
	t.Helper()
	if ExternalS3() {
		ep := os.Getenv("FENCEKIT_S3_ENDPOINT")
		s := &S3Server{Name: "external", Endpoint: ep, Region: os.Getenv("FENCEKIT_S3_REGION"),
			AccessKey: os.Getenv("FENCEKIT_S3_ACCESS_KEY"), SecretKey: os.Getenv("FENCEKIT_S3_SECRET_KEY"),
			Bucket: os.Getenv("FENCEKIT_S3_BUCKET"), External: true}
		if s.Region == "" {
			s.Region = "us-east-1"
		}
		return s
	}
	bin, err := exec.LookPath("versitygw")
	if err != nil {
		bin = filepath.Join(build.Default.GOPATH, "bin", "versitygw")
		if _, serr := os.Stat(bin); serr != nil {
			Missing(t, "versitygw (go install github.com/versity/versitygw/cmd/versitygw@"+VersityVersion+")", err)
		}
	}
	addr := Addr(t)
	s := &S3Server{Name: "versitygw", Endpoint: "http://" + addr, Region: "us-east-1", AccessKey: "fencekit", SecretKey: "fencekit-secret"}
	dir := t.TempDir()
	logf, err := os.Create(filepath.Join(t.TempDir(), "versitygw.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--port", addr, "--access", s.AccessKey, "--secret", s.SecretKey, "--region", s.Region, "posix", dir)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting versitygw: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_, _ = cmd.Process.Wait()
		logf.Close()
	})
	deadline := time.Now().Add(60 * time.Second)
	for Dial(addr) != nil {
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(logf.Name())
			t.Fatalf("versitygw did not listen on %s within 60s:\n%s", addr, b)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return s
}
