package testenv

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// AzuriteVersion is the Azurite (Microsoft's Azure Storage emulator, an npm
// package) the tests run against; scripts/test.sh installs it when missing.
const AzuriteVersion = "3.37.0"

// AzuriteAccount and AzuriteKey are the emulator's well-known development
// account and key (published in Azurite's documentation; not a secret).
const (
	AzuriteAccount = "devstoreaccount1"
	AzuriteKey     = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)

// AzureServer is an Azure Blob Storage endpoint for tests.
type AzureServer struct {
	Name string // "azurite" or "external"
	// ServiceURL is the blob service URL, e.g. http://127.0.0.1:10000/devstoreaccount1/.
	ServiceURL   string
	Account, Key string
	// Container, when set, is the container to use (an external account);
	// otherwise tests create their own.
	Container string
	// External: the account was given by FENCEKIT_AZURE_URL (TLS, maybe
	// remote): tests that put a plain-TCP fault proxy in front of it do not run.
	External bool
	// Host is host:port of the server (a proxy's target).
	Host string
}

// ExternalAzure reports whether FENCEKIT_AZURE_URL names the account of the
// tests, which RealAzure then returns instead of starting Azurite.
func ExternalAzure() bool { return os.Getenv("FENCEKIT_AZURE_URL") != "" }

// AzuriteBinary returns the azurite-blob executable: on PATH, or in
// $FENCEKIT_AZURITE_DIR/node_modules/.bin (scripts/test.sh installs it there
// when npm's global folder is not writable).
func AzuriteBinary() (string, error) {
	bin, err := exec.LookPath("azurite-blob")
	if err == nil {
		return bin, nil
	}
	if d := os.Getenv("FENCEKIT_AZURITE_DIR"); d != "" {
		b := filepath.Join(d, "node_modules", ".bin", "azurite-blob")
		if _, serr := os.Stat(b); serr == nil {
			return b, nil
		}
	}
	return "", err
}

// RealAzure returns the Azure Blob Storage account the tests run against: the
// one named by FENCEKIT_AZURE_URL (the blob service URL, with
// FENCEKIT_AZURE_ACCOUNT, FENCEKIT_AZURE_KEY and FENCEKIT_AZURE_CONTAINER, an
// existing container), or else an Azurite blob server on a temporary folder
// and a free loopback port, with the development account, stopped after the
// test. Without an azurite-blob binary the test skips, or fails when CI is set.
func RealAzure(t testing.TB) *AzureServer {
	t.Helper()
	if ExternalAzure() {
		u := os.Getenv("FENCEKIT_AZURE_URL")
		return &AzureServer{Name: "external", ServiceURL: u, Account: os.Getenv("FENCEKIT_AZURE_ACCOUNT"),
			Key: os.Getenv("FENCEKIT_AZURE_KEY"), Container: os.Getenv("FENCEKIT_AZURE_CONTAINER"), External: true}
	}
	bin, err := AzuriteBinary()
	if err != nil {
		Missing(t, "Azurite (npm install -g azurite@"+AzuriteVersion+", or set FENCEKIT_AZURITE_DIR to a folder it was installed into)", err)
	}
	port := Port(t)
	addr := "127.0.0.1:" + strconv.Itoa(port)
	dir := t.TempDir()
	logf, err := os.Create(filepath.Join(t.TempDir(), "azurite.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--blobHost", "127.0.0.1", "--blobPort", strconv.Itoa(port),
		"--location", dir, "--skipApiVersionCheck", "--disableProductStyleUrl")
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting azurite: %v", err)
	}
	favour(cmd.Process.Pid)
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_, _ = cmd.Process.Wait()
		logf.Close()
	})
	deadline := time.Now().Add(90 * time.Second) // node starts slowly on a loaded machine
	for {
		b, _ := os.ReadFile(logf.Name())
		if Dial(addr) == nil && strings.Contains(string(b), "successfully listens") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("azurite did not listen on %s within 90s:\n%s", addr, b)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return &AzureServer{Name: "azurite", ServiceURL: "http://" + addr + "/" + AzuriteAccount + "/",
		Account: AzuriteAccount, Key: AzuriteKey, Host: addr}
}
