// Command etcdnode runs one member of a test etcd cluster for package
// etcdtest, in a process of its own: built without the race detector, the
// server does not share the CPU budget and the stop-the-world pauses of a
// race-instrumented test binary, which stalled an embedded server for seconds
// under a loaded test run.
//
// It prints "ready" on stdout once the member serves clients, and stops
// gracefully (as embed.Etcd.Close does: a leader hands over its leadership
// first) on SIGTERM or SIGINT, or when its stdin reaches end of file, which
// happens when the test process that started it dies.
package main

import (
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

func main() {
	name := flag.String("name", "node0", "member name")
	dir := flag.String("dir", "", "data directory")
	client := flag.String("client-url", "", "client URL to listen on and advertise")
	peer := flag.String("peer-url", "", "peer URL to listen on and advertise")
	initial := flag.String("initial-cluster", "", "name=peerURL,... of every member")
	token := flag.String("token", "fencekit-test", "initial cluster token")
	flag.Parse()
	if err := run(*name, *dir, *client, *peer, *initial, *token); err != nil {
		fmt.Fprintln(os.Stderr, "etcdnode:", err)
		os.Exit(1)
	}
}

func run(name, dir, client, peer, initial, token string) error {
	if dir == "" || client == "" || peer == "" || initial == "" {
		return fmt.Errorf("-dir, -client-url, -peer-url and -initial-cluster are required")
	}
	cu, err := url.Parse(client)
	if err != nil {
		return fmt.Errorf("-client-url: %w", err)
	}
	pu, err := url.Parse(peer)
	if err != nil {
		return fmt.Errorf("-peer-url: %w", err)
	}
	cfg := embed.NewConfig()
	cfg.Name = name
	cfg.Dir = dir
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{*cu}, []url.URL{*cu}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{*pu}, []url.URL{*pu}
	cfg.InitialCluster = initial
	cfg.InitialClusterToken = token
	cfg.LogLevel = "error"
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return err
	}
	defer e.Close()
	select {
	case <-e.Server.ReadyNotify():
	case <-time.After(2 * time.Minute):
		return fmt.Errorf("member %s not ready after 2m", name)
	}
	fmt.Println("ready")

	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	eof := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(eof)
	}()
	select {
	case <-stop:
	case <-eof:
	case err := <-e.Err():
		return err
	}
	return nil
}
