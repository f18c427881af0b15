package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"
	"syscall"
	"time"

	etcdfence "github.com/fencekit/fencekit/adapters/etcd"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// etcdTiming stretches the lesson for etcd, whose leases are whole seconds and
// at least about two: every lease 2s, every stall past it with room for the
// leader's expiry check.
var etcdTiming = timing{
	lease: 2 * time.Second, stall: 5 * time.Second,
	bugLease: 2 * time.Second,
}

// openEtcdBackend takes locks from etcd (the given endpoints, or an embedded
// single-node etcd) and keeps the protected storage in SQLite (dbPath, or a
// temporary file): the lock and the data need not live in one system.
func openEtcdBackend(ctx context.Context, endpoints, dbPath string) (*backend, error) {
	stopEmbedded := func() {}
	name := "etcd (" + endpoints + ")"
	if endpoints == "" {
		e, dir, err := startEmbeddedEtcd()
		if err != nil {
			return nil, fmt.Errorf("embedded etcd: %w", err)
		}
		stopEmbedded = func() { e.Close(); os.RemoveAll(dir) }
		endpoints = e.Config().ListenClientUrls[0].String()
		name = "embedded etcd (" + endpoints + ")"
	}
	cl, err := connectEtcd(ctx, endpoints)
	if err != nil {
		stopEmbedded()
		return nil, err
	}
	a, err := etcdfence.NewAcquirer(cl, nil)
	if err != nil {
		cl.Close()
		stopEmbedded()
		return nil, err
	}
	store, err := openSQLiteBackend(ctx, dbPath)
	if err != nil {
		cl.Close()
		stopEmbedded()
		return nil, err
	}
	store.name = name + ", storage in " + store.name
	store.acq = a
	store.timing = &etcdTiming
	store.forceRelease = func(ctx context.Context, lock string) error {
		// The plain-DEL mistake on etcd: delete the lock keys, whoever holds them.
		_, err := cl.Delete(ctx, "/fencekit/locks/"+url.PathEscape(lock)+"/", clientv3.WithPrefix())
		return err
	}
	closeStore := store.close
	store.close = func() error {
		err := errors.Join(closeStore(), cl.Close())
		stopEmbedded()
		return err
	}
	return store, nil
}

// etcdStatusTimeout bounds the first request to each endpoint.
const etcdStatusTimeout = 5 * time.Second

// connectEtcd connects to the comma-separated endpoints (user and password
// from ETCDCTL_USERNAME and ETCDCTL_PASSWORD) and checks that one answers a
// status request. When none does, the error names every endpoint and what a
// plain TCP connection to it found, not only the client's deadline.
func connectEtcd(ctx context.Context, endpoints string) (*clientv3.Client, error) {
	eps := strings.Split(endpoints, ",")
	for _, ep := range eps {
		if err := checkURLUserinfo("-etcd-endpoints", ep); err != nil {
			return nil, err
		}
	}
	cl, err := clientv3.New(clientv3.Config{
		Endpoints: eps, DialTimeout: etcdStatusTimeout, Logger: zap.NewNop(),
		Username: os.Getenv("ETCDCTL_USERNAME"), Password: os.Getenv("ETCDCTL_PASSWORD"),
	})
	if err != nil {
		return nil, etcdUnreachable(eps, err)
	}
	var errs []error
	for _, ep := range cl.Endpoints() {
		sctx, cancel := context.WithTimeout(ctx, etcdStatusTimeout)
		_, err := cl.Status(sctx, ep)
		cancel()
		if err == nil {
			return cl, nil
		}
		errs = append(errs, err)
	}
	cl.Close()
	return nil, etcdUnreachable(eps, errors.Join(errs...))
}

// etcdUnreachable describes a failed connection to eps: for each endpoint,
// whether a TCP connection to it succeeds.
func etcdUnreachable(eps []string, err error) error {
	var tried []string
	for _, ep := range eps {
		host := ep
		if u, perr := url.Parse(ep); perr == nil && u.Host != "" {
			host = u.Host
		}
		c, derr := net.DialTimeout("tcp", host, time.Second)
		if derr != nil {
			tried = append(tried, fmt.Sprintf("%s: TCP connect failed (%v)", ep, derr))
			continue
		}
		c.Close()
		tried = append(tried, fmt.Sprintf("%s: TCP connects, but no etcd answer (TLS, auth, or not an etcd client port?)", ep))
	}
	return fmt.Errorf("etcd: no endpoint answered a status request within %v: %s; the client said: %w",
		etcdStatusTimeout, strings.Join(tried, "; "), err)
}

// startEmbeddedEtcd starts a one-member etcd on two free loopback ports. A port
// found free can be taken by another process before etcd binds it, so a bind
// failure is retried on new ports a few times.
func startEmbeddedEtcd() (*embed.Etcd, string, error) {
	for attempt := 1; ; attempt++ {
		e, dir, err := startEmbeddedEtcdOnce()
		inUse := err != nil && (errors.Is(err, syscall.EADDRINUSE) || strings.Contains(err.Error(), "address already in use"))
		if !inUse || attempt == 3 {
			return e, dir, err
		}
	}
}

func startEmbeddedEtcdOnce() (*embed.Etcd, string, error) {
	dir, err := os.MkdirTemp("", "fence-etcd-")
	if err != nil {
		return nil, "", err
	}
	free := func() (*url.URL, error) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		defer l.Close()
		return url.Parse("http://" + l.Addr().String())
	}
	cu, err := free()
	if err != nil {
		return nil, "", err
	}
	pu, err := free()
	if err != nil {
		return nil, "", err
	}
	cfg := embed.NewConfig()
	cfg.Dir = dir
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{*cu}, []url.URL{*cu}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{*pu}, []url.URL{*pu}
	cfg.InitialCluster = cfg.Name + "=" + pu.String()
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		os.RemoveAll(dir)
		return nil, "", err
	}
	select {
	case <-e.Server.ReadyNotify():
		return e, dir, nil
	case <-time.After(30 * time.Second):
		e.Close()
		os.RemoveAll(dir)
		return nil, "", errors.New("not ready after 30s")
	}
}
