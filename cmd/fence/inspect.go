package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net/url"
	"strconv"
	"strings"
	"time"

	azfence "github.com/fencekit/fencekit/adapters/azure"
	etcdfence "github.com/fencekit/fencekit/adapters/etcd"
	gcsfence "github.com/fencekit/fencekit/adapters/gcs"
	"github.com/fencekit/fencekit/adapters/redislua"
	s3fence "github.com/fencekit/fencekit/adapters/s3"
	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
)

// parseWithName parses flags given before and after the one positional
// argument (the lock name), as "fence bump NAME -to N" and "fence bump -to N NAME"
// both read naturally.
func parseWithName(fs *flagSet, args []string) (string, error) {
	var names []string
	for {
		if err := fs.parse(args); err != nil {
			return "", err
		}
		if fs.NArg() == 0 {
			break
		}
		names = append(names, fs.Arg(0))
		args = fs.Args()[1:]
	}
	switch len(names) {
	case 0:
		return "", usagef("missing the lock NAME")
	case 1:
	default:
		return "", usagef("want one lock NAME, got %d: %q", len(names), names)
	}
	return names[0], nil
}

func runInspect(args []string, stdout, stderr io.Writer) error {
	fs, bc := commandFlags("inspect", "inspect [flags] NAME",
		"Shows the lock NAME on a backend: whether it is held, the holder's token, owner\n"+
			"and time left, and the token counter (every later grant is larger); with -key,\n"+
			"the token a protected key holds. Exit status 1 for an unreachable backend or an\n"+
			"unknown name, 2 for bad usage or when the flags do not name a backend:\n"+
			"inspect never looks at a default, temporary or embedded one.", true, stdout, stderr)
	key := fs.String("key", "", "also show the token stored for this protected key (the writer's default table, hash or objects)")
	name, err := parseWithName(fs, args)
	if err != nil {
		return err
	}
	if err := bc.checkFlags(fs.FlagSet); err != nil {
		return err
	}
	if err := bc.checkOperator(*key); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b, err := openOperator(ctx, *bc, *key != "")
	if err != nil {
		return err
	}
	defer b.close()
	in, ok := b.acq.(fence.Inspector)
	if !ok {
		return fmt.Errorf("backend %s cannot inspect locks", bc.name)
	}
	info, err := in.Inspect(ctx, name)
	if err != nil {
		if errors.Is(err, fence.ErrNotFound) {
			return fmt.Errorf("no lock named %q on %s (never granted)", name, b.name)
		}
		return operatorError(err)
	}
	// The key is read before anything is printed: a key the backend refuses
	// is bad usage, with nothing on stdout.
	keyLine := ""
	if *key != "" && b.fenced != nil {
		v, tok, err := b.fenced.Read(ctx, *key)
		switch {
		case errors.Is(err, fence.ErrNotFound):
			keyLine = fmt.Sprintf("  key %q: no value\n", *key)
		case err != nil:
			return operatorError(err)
		default:
			keyLine = fmt.Sprintf("  key %q: token %d, %d bytes\n", *key, tok, len(v))
		}
	}
	fmt.Fprintf(stdout, "lock %q on %s\n", name, b.name)
	if info.Held {
		fmt.Fprintf(stdout, "  held:      yes, token %d, owner %s, %v left\n", info.Token, info.Owner, info.TimeLeft.Round(time.Millisecond))
	} else {
		fmt.Fprintf(stdout, "  held:      no\n")
	}
	fmt.Fprintf(stdout, "  counter:   %d (every later grant's token is larger)\n", info.Counter)
	fmt.Fprint(stdout, keyLine)
	return nil
}

func runBump(args []string, stdout, stderr io.Writer) error {
	fs, bc := commandFlags("bump", "bump [flags] NAME -to N",
		"Raises the token counter of lock NAME to N, so every later grant's token is\n"+
			"larger: for example after a Redis failover lost the counter. It refuses to\n"+
			"lower a counter (exit status 1). On SQL backends it refuses while the lock is\n"+
			"held. etcd and NATS tokens are revisions, and S3, GCS and Azure lock objects have\n"+
			"no bump: they refuse.\n"+
			"Exit status 2 for bad usage or when the flags do not name a backend: bump\n"+
			"never acts on a default, temporary or embedded one.", true, stdout, stderr)
	to := fs.String("to", "", "the value to raise the counter to (required)")
	name, err := parseWithName(fs, args)
	if err != nil {
		return err
	}
	n, err := strconv.ParseUint(*to, 10, 64)
	if err != nil || !fence.Token(n).Valid() {
		return usagef("-to wants a token in 1..%d, got %q", uint64(fence.MaxToken), *to)
	}
	if err := bc.checkFlags(fs.FlagSet); err != nil {
		return err
	}
	if err := bc.checkOperator(""); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b, err := openOperator(ctx, *bc, false)
	if err != nil {
		return err
	}
	defer b.close()
	bu, ok := b.acq.(fence.Bumper)
	if !ok {
		return fmt.Errorf("backend %s has no counter to bump (etcd and NATS tokens are revisions; S3, GCS and Azure lock objects cannot be bumped)", bc.name)
	}
	if err := bu.Bump(ctx, name, fence.Token(n)); err != nil {
		return operatorError(err)
	}
	fmt.Fprintf(stdout, "lock %q on %s: counter raised to %d\n", name, b.name, n)
	return nil
}

// operatorError words an error of inspect's or bump's backend call for the
// command line, without the fence package's "fence: OP: invalid ARG:" prefix:
// a lock name or key the backend refuses is bad usage (exit status 2), a -to
// that would not raise the counter a refusal (exit status 1).
func operatorError(err error) error {
	var inv *fence.InvalidError
	if !errors.As(err, &inv) {
		return err
	}
	switch inv.Arg {
	case "name":
		return usagef("invalid lock NAME: %s", inv.Reason)
	case "key":
		return usagef("invalid -key: %s", inv.Reason)
	case "to":
		return fmt.Errorf("-to: %s", inv.Reason)
	default:
		return fmt.Errorf("invalid %s: %s", inv.Arg, inv.Reason)
	}
}

// openOperatorSQLite opens an operator's existing SQLite file as it is: never
// created (mode=rw), its journal mode left as the application set it
// (sqlfence.OpenSQLite would switch it to WAL, and make an empty file a
// database).
func openOperatorSQLite(path string) (*sql.DB, error) {
	q := url.Values{}
	q.Add("_pragma", "busy_timeout(10000)")
	q.Set("_txlock", "immediate")
	q.Set("mode", "rw")
	db, err := sql.Open("sqlite", "file:"+path+"?"+q.Encode())
	if err == nil {
		if err = db.Ping(); err != nil {
			db.Close()
		}
	}
	if err != nil {
		return nil, fmt.Errorf("open sqlite %s: %w", path, err)
	}
	return db, nil
}

// openOperator opens the backend an operator's flags name (checkOperator has
// passed): its acquirer and, with keys, the fenced writer that reads a
// protected key's token. Nothing is created: a missing table is an error that
// names it.
func openOperator(ctx context.Context, c backendConfig, keys bool) (*backend, error) {
	sqlOps := func(name string, fdb *sqlfence.DB, closeFn func() error) (*backend, error) {
		a, err := sqlfence.NewAcquirer(fdb, nil)
		if err != nil {
			return nil, errors.Join(err, closeFn())
		}
		b := &backend{name: name, acq: a, close: closeFn}
		if keys {
			if b.fenced, err = sqlfence.NewWriter(fdb, nil); err != nil {
				return nil, errors.Join(err, closeFn())
			}
		}
		return b, nil
	}
	switch c.name {
	case "sqlite":
		db, err := openOperatorSQLite(c.dbPath)
		if err != nil {
			return nil, err
		}
		return sqlOps("sqlite ("+c.dbPath+")", sqlfence.SQLite(db), db.Close)
	case "postgres":
		p, name, err := connectPostgres(ctx, c.postgresURL)
		if err != nil {
			return nil, err
		}
		return sqlOps(name, sqlfence.Pgx(p), func() error { p.Close(); return nil })
	case "mysql":
		db, name, err := connectMySQL(ctx, c.mysqlDSN)
		if err != nil {
			return nil, err
		}
		return sqlOps(name, sqlfence.MySQL(db), db.Close)
	case "redis":
		cl, name, err := connectRedis(ctx, c)
		if err != nil {
			return nil, err
		}
		a, err := redislua.NewAcquirer(cl, nil)
		if err != nil {
			return nil, errors.Join(err, cl.Close())
		}
		w, err := redislua.NewWriter(cl, nil)
		if err != nil {
			return nil, errors.Join(err, cl.Close())
		}
		return &backend{name: name, acq: a, fenced: w, close: cl.Close}, nil
	case "etcd":
		cl, err := connectEtcd(ctx, c.etcd)
		if err != nil {
			return nil, err
		}
		a, err := etcdfence.NewAcquirer(cl, nil)
		if err != nil {
			return nil, errors.Join(err, cl.Close())
		}
		b := &backend{name: "etcd (" + c.etcd + ")", acq: a, close: cl.Close}
		if keys {
			db, err := openOperatorSQLite(c.dbPath)
			if err != nil {
				return nil, errors.Join(err, cl.Close())
			}
			w, err := sqlfence.NewWriter(sqlfence.SQLite(db), nil)
			if err != nil {
				return nil, errors.Join(err, db.Close(), cl.Close())
			}
			b.fenced = w
			b.close = func() error { return errors.Join(db.Close(), cl.Close()) }
		}
		return b, nil
	case "s3":
		sc, err := connectS3(ctx, c)
		if err != nil {
			return nil, err
		}
		a, err := s3fence.NewAcquirer(sc.c, sc.bucket, nil)
		if err != nil {
			return nil, err
		}
		w, err := s3fence.NewWriter(sc.c, sc.bucket, nil)
		if err != nil {
			return nil, err
		}
		return &backend{name: sc.name, acq: a, fenced: w, close: func() error { sc.close(); return nil }}, nil
	case "nats":
		return openNATSOperator(ctx, c, keys)
	case "gcs":
		bucket, _, name, closeGCS, err := connectGCS(ctx, c)
		if err != nil {
			return nil, err
		}
		a, err := gcsfence.NewAcquirer(bucket, nil)
		if err != nil {
			closeGCS()
			return nil, err
		}
		w, err := gcsfence.NewWriter(bucket, nil)
		if err != nil {
			closeGCS()
			return nil, err
		}
		return &backend{name: name, acq: a, fenced: w, close: func() error { closeGCS(); return nil }}, nil
	case "azure":
		cl, name, stop, err := connectAzure(ctx, c)
		if err != nil {
			return nil, err
		}
		a, err := azfence.NewAcquirer(cl, nil)
		if err != nil {
			stop()
			return nil, err
		}
		w, err := azfence.NewWriter(cl, nil)
		if err != nil {
			stop()
			return nil, err
		}
		return &backend{name: name, acq: a, fenced: w, close: func() error { stop(); return nil }}, nil
	default:
		return nil, usagef("unknown backend %q (have: %s)", c.name, strings.Join(backendNames, ", "))
	}
}
