package sqlfence_test

import (
	"testing"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/benchutil"
)

// BenchmarkFlakyNetwork: 8 workers x 200 locked increments of one counter
// (Acquire, Read, fenced Write, Release) through a fault proxy with 1-3 ms
// jitter, then with 2% cuts too (benchutil.FlakyNetwork), on PostgreSQL and
// MariaDB. Run it alone, once:
//
//	go test -run '^$' -bench BenchmarkFlakyNetwork -benchtime 1x ./adapters/sql/
func BenchmarkFlakyNetwork(b *testing.B) {
	benchutil.FlakyNetwork(b,
		benchutil.Flaky{Name: "postgres", Target: func(b *testing.B) string { return pgTarget(b) }, Open: sqlFlaky(flakyPostgres)},
		benchutil.Flaky{Name: "mysql", Target: func(b *testing.B) string { return mysqlAddr(b) }, Open: sqlFlaky(flakyMySQL)},
	)
}

// sqlFlaky returns a benchutil.Flaky's Open: an acquirer and a writer on the
// database open returns.
func sqlFlaky(open func(b *testing.B, p *faultnet.Proxy) *sqlfence.DB) func(b *testing.B, p *faultnet.Proxy) (fence.Acquirer, benchutil.Store) {
	return func(b *testing.B, p *faultnet.Proxy) (fence.Acquirer, benchutil.Store) {
		db := open(b, p)
		a, err := sqlfence.NewAcquirer(db, nil)
		if err != nil {
			b.Fatal(err)
		}
		w, err := sqlfence.NewWriter(db, nil)
		if err != nil {
			b.Fatal(err)
		}
		return a, w
	}
}

func flakyPostgres(b *testing.B, p *faultnet.Proxy) *sqlfence.DB {
	pgPool(b, pgOpts{}) // the default tables
	// pgx's default pool has max(4, CPUs) connections, one of them kept by
	// the release listener: size it for the 8 workers, as their user would.
	return sqlfence.Pgx(proxiedPool(b, p, 16))
}

func flakyMySQL(b *testing.B, p *faultnet.Proxy) *sqlfence.DB {
	openMySQL(b, "") // the default tables
	db := proxiedMySQL(b, p)
	// database/sql keeps 2 idle connections by default: 8 workers would
	// open a connection (a handshake through the jitter) for most requests.
	db.SetMaxIdleConns(16)
	return sqlfence.MySQL(db)
}
