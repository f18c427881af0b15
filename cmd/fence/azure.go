package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore/streaming"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/bloberror"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/container"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/lease"
	azfence "github.com/fencekit/fencekit/adapters/azure"
	"github.com/fencekit/fencekit/fence"
)

// azureTiming stretches the lesson for Azure leases, which last 15 s at least.
var azureTiming = timing{
	lease: azfence.MinLeaseDuration, stall: 18 * time.Second,
	bugLease: azfence.MinLeaseDuration,
}

// Azurite's published development account (not a secret).
const (
	azuriteAccount = "devstoreaccount1"
	azuriteKey     = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)

// connectAzure returns a client of the container the flags name (account and
// key from AZURE_STORAGE_ACCOUNT and AZURE_STORAGE_KEY); or, when
// -azure-url is empty, of a new container on an Azurite (azurite-blob on
// PATH or in FENCEKIT_AZURITE_DIR) started on a temporary folder, stopped by
// the returned func.
func connectAzure(ctx context.Context, cfg backendConfig) (*container.Client, string, func(), error) {
	if cfg.azureURL == "" {
		return startAzurite(ctx)
	}
	if cfg.azureContainer == "" {
		return nil, "", nil, usagef("-azure-url needs -azure-container")
	}
	if err := checkURLUserinfo("-azure-url", cfg.azureURL); err != nil {
		return nil, "", nil, err
	}
	u, err := url.Parse(cfg.azureURL)
	if err != nil || u.Scheme == "" || u.Host == "" {
		return nil, "", nil, usagef("-azure-url %s is not a URL such as https://ACCOUNT.blob.core.windows.net/", redactConn(cfg.azureURL))
	}
	cred, err := azblob.NewSharedKeyCredential(os.Getenv("AZURE_STORAGE_ACCOUNT"), os.Getenv("AZURE_STORAGE_KEY"))
	if err != nil {
		return nil, "", nil, usagef("AZURE_STORAGE_KEY: %v", err)
	}
	sc, err := azblob.NewClientWithSharedKeyCredential(cfg.azureURL, cred, nil)
	if err != nil {
		return nil, "", nil, err
	}
	c := sc.ServiceClient().NewContainerClient(cfg.azureContainer)
	if _, err := c.GetProperties(ctx, nil); err != nil {
		return nil, "", nil, fmt.Errorf("container %s: %w", cfg.azureContainer, err)
	}
	return c, "Azure " + u.Host + "/" + cfg.azureContainer, func() {}, nil
}

// startAzurite starts an Azurite blob server for the demo.
func startAzurite(ctx context.Context) (*container.Client, string, func(), error) {
	bin, err := exec.LookPath("azurite-blob")
	if err != nil && os.Getenv("FENCEKIT_AZURITE_DIR") != "" {
		bin, err = filepath.Join(os.Getenv("FENCEKIT_AZURITE_DIR"), "node_modules", ".bin", "azurite-blob"), nil
	}
	if err != nil {
		return nil, "", nil, fmt.Errorf("-backend azure without -azure-url starts Azurite, which is not installed (npm install -g azurite, or set FENCEKIT_AZURITE_DIR): %w", err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, "", nil, err
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	dir, err := os.MkdirTemp("", "fence-azurite-")
	if err != nil {
		return nil, "", nil, err
	}
	var out bytes.Buffer
	cmd := exec.Command(bin, "--blobHost", "127.0.0.1", "--blobPort", strconv.Itoa(port), "--location", dir, "--skipApiVersionCheck", "--disableProductStyleUrl")
	cmd.Stdout, cmd.Stderr = &out, io.Discard
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, "", nil, err
	}
	stop := func() { _ = cmd.Process.Kill(); _, _ = cmd.Process.Wait(); os.RemoveAll(dir) }
	endpoint := fmt.Sprintf("http://127.0.0.1:%d/%s/", port, azuriteAccount)
	cred, _ := azblob.NewSharedKeyCredential(azuriteAccount, azuriteKey)
	sc, err := azblob.NewClientWithSharedKeyCredential(endpoint, cred, nil)
	if err != nil {
		stop()
		return nil, "", nil, err
	}
	c := sc.ServiceClient().NewContainerClient("fence-demo")
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := c.Create(ctx, nil)
		if err == nil {
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			stop()
			return nil, "", nil, fmt.Errorf("fence: azurite did not answer on port %d within 30s: %w", port, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return c, "Azurite (" + endpoint + ")", stop, nil
}

func openAzureBackend(ctx context.Context, cfg backendConfig) (*backend, error) {
	c, where, stop, err := connectAzure(ctx, cfg)
	if err != nil {
		return nil, err
	}
	w, err := azfence.NewWriter(c, nil)
	if err != nil {
		stop()
		return nil, err
	}
	a, err := azfence.NewAcquirer(c, &azfence.AcquirerOptions{Backoff: fence.Backoff{Min: 10 * time.Millisecond, Max: 200 * time.Millisecond}})
	if err != nil {
		stop()
		return nil, err
	}
	b, err := openSQLiteBackend(ctx, cfg.dbPath)
	if err != nil {
		stop()
		return nil, err
	}
	b.name = where + ": data and locks; idempotency keys in " + b.name
	b.acq, b.fenced, b.timing = a, w, &azureTiming
	b.forceRelease = func(ctx context.Context, name string) error {
		// The lesson's bug on a blob lease: break it, whoever holds it.
		lc, err := lease.NewBlobClient(c.NewBlobClient("fencekit-locks/"+name), nil)
		if err != nil {
			return err
		}
		zero := int32(0)
		_, err = lc.BreakLease(ctx, &lease.BlobBreakOptions{BreakPeriod: &zero})
		return err
	}
	b.plainPut = func(ctx context.Context, key string, value []byte) error {
		_, err := c.NewBlockBlobClient("plain/"+key).Upload(ctx, streaming.NopCloser(bytes.NewReader(value)), nil)
		return err
	}
	b.plainGet = func(ctx context.Context, key string) ([]byte, error) {
		out, err := c.NewBlobClient("plain/"+key).DownloadStream(ctx, nil)
		if bloberror.HasCode(err, bloberror.BlobNotFound) {
			return nil, fence.ErrNotFound
		}
		if err != nil {
			return nil, err
		}
		defer out.Body.Close()
		return io.ReadAll(out.Body)
	}
	closeLocks := b.close
	b.close = func() error { stop(); return closeLocks() }
	return b, nil
}
