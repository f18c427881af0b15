package sqlfence_test

import (
	"context"
	"errors"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

// pgExpiresAt reads name's expires_at in the default lease table, directly.
func pgExpiresAt(t *testing.T, direct *pgxpool.Pool, name string) int64 {
	t.Helper()
	var e int64
	if err := direct.QueryRow(context.Background(), "SELECT expires_at FROM fence_leases WHERE name = $1", name).Scan(&e); err != nil {
		t.Fatal(err)
	}
	return e
}

// TestRenewRetryNotSentAfterLostReply (HAZARDS 3): a renewal reaches the
// server and extends the row, and its reply is lost; Renew runs it again,
// and that retry sends nothing: the pool has no connection for it (a refused
// dial, or the context ends while another caller holds the pool's only
// connection). The first attempt may have extended the lease, so Renew
// cannot know: it must return an error matching fence.ErrUnknown (as
// Release and Acquire do in the same case), never a definite failure.
func TestRenewRetryNotSentAfterLostReply(t *testing.T) {
	direct := pgPool(t, pgOpts{})
	type handle struct {
		fdb *sqlfence.DB
		// hold takes the handle's only connection as soon as one is free,
		// and gives it back when release is called.
		hold func(ctx context.Context) (release func(), err error)
	}
	styles := map[string]func(t *testing.T, px *faultnet.Proxy) handle{
		"pgx": func(t *testing.T, px *faultnet.Proxy) handle {
			p := proxiedPool(t, px, 1)
			return handle{sqlfence.Pgx(p), func(ctx context.Context) (func(), error) {
				c, err := p.Acquire(ctx)
				if err != nil {
					return nil, err
				}
				return c.Release, nil
			}}
		},
		"database-sql": func(t *testing.T, px *faultnet.Proxy) handle {
			cc, err := pgx.ParseConfig(pgURLVia(t, px))
			if err != nil {
				t.Fatal(err)
			}
			db := stdlib.OpenDB(*cc)
			db.SetMaxOpenConns(1)
			t.Cleanup(func() { db.Close() })
			return handle{sqlfence.Postgres(db), func(ctx context.Context) (func(), error) {
				c, err := db.Conn(ctx)
				if err != nil {
					return nil, err
				}
				return func() { c.Close() }, nil
			}}
		},
	}
	for style, open := range styles {
		for _, retry := range []string{"refused dial", "context ends waiting for the pool"} {
			t.Run(style+"/"+retry, func(t *testing.T) {
				px := faultnet.Start(t, pgTarget(t))
				h := open(t, px)
				a := newAcquirerOn(t, h.fdb, nil)
				name := fencetest.Name("renew-retry")
				ctx := context.Background()
				l, err := a.TryAcquire(ctx, name, time.Minute) // the pool's one connection is open
				if err != nil {
					t.Fatal(err)
				}
				before := pgExpiresAt(t, direct, name)

				held := make(chan func(), 1)
				rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
				defer cancel()
				switch retry {
				case "refused dial":
					px.Refuse(true) // the open connection goes on; a new one is refused
				default:
					// The connection is cut 300ms after the renewal is
					// forwarded; meanwhile another caller waits for the
					// pool's only connection, and takes the one the pool
					// opens once the cut one is gone.
					px.ReplyWindow(300 * time.Millisecond)
				}
				px.LoseReply(carrying(name))
				done := make(chan error, 1)
				go func() { done <- l.Renew(rctx) }()
				if retry != "refused dial" {
					for px.Pending() != 0 {
						select {
						case err := <-done:
							t.Fatalf("Renew returned before its request reached the proxy: %v", err)
						case <-time.After(time.Millisecond): // polling the proxy's state
						}
					}
					go func() {
						rel, err := h.hold(ctx)
						if err != nil {
							t.Error(err)
							rel = func() {}
						}
						held <- rel
					}()
				}
				err = <-done
				if retry != "refused dial" {
					(<-held)()
				}
				px.Refuse(false)
				if st := px.Stats(); st.LostReplies != 1 {
					t.Fatalf("%d lost replies, want 1: the test did not test it", st.LostReplies)
				}
				after := pgExpiresAt(t, direct, name)
				if after <= before {
					t.Fatalf("expires_at %d after the renewal, %d before: the lost renewal did not land, the test did not test it", after, before)
				}
				if err == nil {
					return // recognised (a later attempt got through): fine
				}
				if !errors.Is(err, fence.ErrUnknown) {
					t.Errorf("Renew whose first attempt extended the row (expires_at %d -> %d) and whose retry was not sent: %v; want an error matching fence.ErrUnknown", before, after, err)
				}
			})
		}
	}
}

// pgURLVia is the test server's URL with its host and port replaced by px's.
func pgURLVia(t *testing.T, px *faultnet.Proxy) string {
	t.Helper()
	cc, err := pgx.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	u := "postgres://" + cc.User + "@" + px.Addr() + "/" + cc.Database + "?sslmode=disable"
	if cc.Password != "" {
		u = "postgres://" + cc.User + ":" + cc.Password + "@" + px.Addr() + "/" + cc.Database + "?sslmode=disable"
	}
	return u
}
