// Package etcdtest starts embedded etcd servers on loopback ports for tests: one
// node, or a cluster of several.
package etcdtest

import (
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/fencekit/fencekit/internal/testenv"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// Node is one member of an embedded cluster.
type Node struct {
	Name      string
	ClientURL string
	Etcd      *embed.Etcd
	cfg       *embed.Config
}

// Cluster is a running embedded etcd cluster.
type Cluster struct {
	Nodes []*Node
}

// freeURL reserves a loopback port (testenv.Port: never one another test
// binary or an outgoing connection can take meanwhile).
func freeURL(t testing.TB) *url.URL {
	t.Helper()
	u, _ := url.Parse("http://" + testenv.Addr(t))
	return u
}

// Start starts an n-member cluster with data in temporary directories, and
// stops it at the end of the test.
func Start(t testing.TB, n int) *Cluster {
	t.Helper()
	c := &Cluster{}
	var initial []string
	for i := 0; i < n; i++ {
		cfg := embed.NewConfig()
		cfg.Name = fmt.Sprintf("node%d", i)
		cfg.Dir = t.TempDir()
		cu, pu := freeURL(t), freeURL(t)
		cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{*cu}, []url.URL{*cu}
		cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{*pu}, []url.URL{*pu}
		cfg.LogLevel = "error"
		cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
		cfg.InitialClusterToken = "fencekit-test"
		c.Nodes = append(c.Nodes, &Node{Name: cfg.Name, ClientURL: cu.String(), cfg: cfg})
		initial = append(initial, fmt.Sprintf("%s=%s", cfg.Name, pu.String()))
	}
	errs := make(chan error, n)
	for _, nd := range c.Nodes {
		nd.cfg.InitialCluster = strings.Join(initial, ",")
		go func() {
			e, err := embed.StartEtcd(nd.cfg)
			nd.Etcd = e
			errs <- err
		}()
	}
	for range c.Nodes {
		if err := <-errs; err != nil {
			t.Fatalf("starting embedded etcd: %v", err)
		}
	}
	t.Cleanup(c.Stop)
	for _, nd := range c.Nodes {
		select {
		case <-nd.Etcd.Server.ReadyNotify():
		case <-time.After(30 * time.Second):
			t.Fatalf("embedded etcd %s not ready", nd.Name)
		}
	}
	return c
}

// Endpoints returns the client URLs of the running members.
func (c *Cluster) Endpoints() []string {
	var eps []string
	for _, nd := range c.Nodes {
		if nd.Etcd != nil {
			eps = append(eps, nd.ClientURL)
		}
	}
	return eps
}

// Client returns a client of every member, closed at the end of the test.
func (c *Cluster) Client(t testing.TB) *clientv3.Client {
	t.Helper()
	return NewClient(t, c.Endpoints()...)
}

// ClientAddr returns member i's client address, host:port (for a proxy).
func (c *Cluster) ClientAddr(i int) string {
	u, _ := url.Parse(c.Nodes[i].ClientURL)
	return u.Host
}

// NewClient returns a client of endpoints (host:port or URLs; a fault proxy's
// address), closed at the end of the test.
func NewClient(t testing.TB, endpoints ...string) *clientv3.Client {
	t.Helper()
	cl, err := clientv3.New(clientv3.Config{Endpoints: endpoints, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	return cl
}

// Leader returns the index of the current leader.
func (c *Cluster) Leader() int {
	for i, nd := range c.Nodes {
		if nd.Etcd != nil && nd.Etcd.Server.Leader() == nd.Etcd.Server.MemberID() {
			return i
		}
	}
	return -1
}

// StopNode stops member i.
func (c *Cluster) StopNode(i int) {
	if nd := c.Nodes[i]; nd.Etcd != nil {
		nd.Etcd.Close()
		nd.Etcd = nil
	}
}

// Stop stops every member.
func (c *Cluster) Stop() {
	for i := range c.Nodes {
		c.StopNode(i)
	}
}
