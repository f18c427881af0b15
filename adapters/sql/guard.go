package sqlfence

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// GuardOptions configures Guards. A nil *GuardOptions means the defaults.
type GuardOptions struct {
	// Table holds one fence row per lock name; it may be schema-qualified.
	// On MySQL its name column must compare bytes, as WriterOptions.KeyColumn
	// says; otherwise Guard (and a grant that advances the guards) returns an
	// error matching fence.ErrInvalid. Default: "fence_guards".
	Table string
}

// Guards fences whole transactions: Guard advances a per-lock fence row inside
// the caller's own transaction, so that every ordinary write in that transaction
// is fenced together with it. It is safe for concurrent use.
//
// # Isolation
//
// Guard's statement takes the guard row's lock until the transaction ends, so
// concurrent guarded transactions on one name run one after the other. A
// transaction whose token is lower than one already committed gets ErrStale and
// must roll back.
//
//   - READ COMMITTED (PostgreSQL's default) is enough: a guard waiting on the row
//     lock re-checks the fence against the committed row when it gets the lock.
//     Call Guard before the writes it protects.
//   - REPEATABLE READ and SERIALIZABLE also work, but a guard that waited for a
//     concurrent guarded transaction fails with a serialization failure (40001)
//     instead; run the transaction again from the start ([RunTx] does).
//   - SQLite transactions are serializable; with [OpenSQLite] they take the
//     write lock when they begin.
type Guards struct {
	db    *DB
	table string
	ddl   string
	// insertPrefix and onConflictUp build the guard upsert; the acquirer's
	// advance-on-grant reuses them.
	insertPrefix, onConflictUp string
	guard, current             string
	// mysql: the statements are MySQL's; advanceSQL builds the upsert with
	// the offered token as the SQL expression v.
	mysql      bool
	advanceSQL func(v string) string
	keys       *keyColumn // MySQL: the name column must compare bytes
}

// NewGuards returns Guards whose table is on db, in db's dialect. It does not
// touch the database; see CreateTable. It returns an error matching
// fence.ErrInvalid for a nil db and for a table name that is not a plain SQL
// identifier.
func NewGuards(db *DB, opts *GuardOptions) (*Guards, error) {
	if err := db.check("new guards"); err != nil {
		return nil, err
	}
	table := "fence_guards"
	if opts != nil && opts.Table != "" {
		table = opts.Table
	}
	d := db.d
	t, err := d.quoteIdent("new guards", "table", table, true)
	if err != nil {
		return nil, err
	}
	g := &Guards{db: db, table: table, mysql: d == mysqlDialect}
	if d == postgresDialect {
		g.keys = newPgKeyColumn("table", table, t, "name", "name")
	}
	if g.mysql {
		g.keys = newKeyColumn("table", table, "name", "name")
		g.ddl = fmt.Sprintf("CREATE TABLE IF NOT EXISTS %s (\n  name %s PRIMARY KEY,\n  fence BIGINT NOT NULL CHECK (fence BETWEEN 1 AND %d)\n)", t, d.keyType, uint64(fence.MaxToken))
		// LAST_INSERT_ID is the token when the fence was advanced or equal,
		// 0 when it holds a larger one (see execID), or when the row found
		// is another name's (a name column that merges names). v is the
		// offered token.
		g.advanceSQL = func(v string) string {
			return fmt.Sprintf("INSERT INTO %s (name, fence) VALUES (%s, LAST_INSERT_ID(%s)) ON DUPLICATE KEY UPDATE "+
				"fence = IF(fence <= VALUES(fence) AND %s, LAST_INSERT_ID(VALUES(fence)), LAST_INSERT_ID(0) + fence)", t, mysqlText, v, sameKey("name"))
		}
		g.guard = g.advanceSQL("?")
		// A locking read: the latest committed fence, whatever the isolation.
		g.current = fmt.Sprintf("SELECT fence FROM %s WHERE name = %s FOR UPDATE", t, mysqlText)
		return g, nil
	}
	// BIGINT and TEXT mean the same to SQLite and PostgreSQL, so one DDL serves both.
	g.ddl = fmt.Sprintf("CREATE TABLE IF NOT EXISTS %s (\n  name TEXT PRIMARY KEY,\n  fence BIGINT NOT NULL CHECK (fence BETWEEN 1 AND %d)\n)", t, uint64(fence.MaxToken))
	g.insertPrefix = fmt.Sprintf("INSERT INTO %s AS cur (name, fence)", t)
	g.onConflictUp = "ON CONFLICT (name) DO UPDATE SET fence = excluded.fence WHERE cur.fence <= excluded.fence"
	g.guard = fmt.Sprintf("%s VALUES ($1, $2) %s", g.insertPrefix, g.onConflictUp)
	if d == postgresDialect {
		// The guard's fence must survive a crash with the caller's commit,
		// also where synchronous_commit is off (see pgDurable).
		g.guard = pgDurableChange(g.guard)
	}
	g.current = fmt.Sprintf("SELECT fence FROM %s WHERE name = $1", t)
	return g, nil
}

// DDL returns the CREATE TABLE statement of the guard table in the dialect of
// the Guards' database, for an operator to run instead of CreateTable.
func (g *Guards) DDL() string { return g.ddl }

// CreateTable creates the guard table on the Guards' database if it does not
// exist. Running it again, also concurrently, is harmless.
func (g *Guards) CreateTable(ctx context.Context) error {
	return g.db.createTable(ctx, g.ddl)
}

// Guard advances the fence of name to token inside tx, the caller's own
// database/sql transaction, on a database of the Guards' dialect (SQLite,
// PostgreSQL or MySQL). A token lower than one already committed for name
// returns a *fence.StaleError (matching fence.ErrStale); then nothing was
// changed and the caller must roll back. Until tx ends, concurrent guards on
// name wait for it, so the writes made in tx after Guard returns nil commit
// only if no larger token has been committed first.
//
// A nil ctx or tx, an empty name or an invalid token returns an error matching
// fence.ErrInvalid, before any statement runs. A missing guard table returns a
// *TableError. Any other error is the driver's, and tx should be rolled back.
func (g *Guards) Guard(ctx context.Context, tx *sql.Tx, name string, token fence.Token) error {
	if err := g.checkGuard("guard", ctx, name, token); err != nil {
		return err
	}
	c, err := stdTxConn("guard", g.db.d, tx)
	if err != nil {
		return err
	}
	return g.guardOn(ctx, c, name, token)
}

// GuardPgx is Guard for a native pgx transaction (a pgx.Tx, such as the one
// RunPgxTx passes, or a *pgxpool.Tx) on PostgreSQL, with the same guarantees
// and errors. On Guards whose database is not PostgreSQL it returns an error
// matching fence.ErrInvalid, before any statement runs.
func (g *Guards) GuardPgx(ctx context.Context, tx pgx.Tx, name string, token fence.Token) error {
	if err := g.checkGuard("guard", ctx, name, token); err != nil {
		return err
	}
	c, err := pgxTxConn("guard", g.db.d, tx)
	if err != nil {
		return err
	}
	return g.guardOn(ctx, c, name, token)
}

// checkGuard refuses bad arguments with an error matching fence.ErrInvalid.
func (g *Guards) checkGuard(op string, ctx context.Context, name string, token fence.Token) error {
	if err := leasekit.CheckContext(op, ctx); err != nil {
		return err
	}
	if err := checkText(op, "name", name); err != nil {
		return err
	}
	return leasekit.CheckToken(op, token)
}

// guardOn runs the guard statement on c, the caller's transaction.
func (g *Guards) guardOn(ctx context.Context, c conn, name string, token fence.Token) error {
	if err := g.keys.check(ctx, c, "guard", name); err != nil {
		return err
	}
	if g.mysql {
		id, err := execID(ctx, c, g.guard, textArg(true, name), int64(token))
		if err != nil {
			return g.wrap(err)
		}
		if id > 0 {
			return nil
		}
	} else {
		n, err := c.exec(ctx, g.guard, name, int64(token))
		if err != nil {
			return g.wrap(err)
		}
		if n > 0 {
			return nil
		}
	}
	var cur int64
	if err := c.queryRow(ctx, g.current, []any{textArg(g.mysql, name)}, &cur); err != nil {
		if errors.Is(err, errNoRows) {
			// Refused by a row that is not the name's own: the name
			// column merges names (see keyColumn).
			if cerr := g.keys.recheck(ctx, c, "guard", name); cerr != nil {
				return cerr
			}
		}
		return g.wrap(err)
	}
	if fence.Token(cur) <= token {
		return fmt.Errorf("sqlfence: guard %q: the fence row holds %d, not above token %d, yet it was not advanced: the guard table was changed outside sqlfence", name, cur, token)
	}
	return &fence.StaleError{Key: name, Offered: token, Current: fence.Token(cur)}
}

// stdTxConn wraps the caller's database/sql transaction on a database of
// dialect d; a nil tx returns an error matching fence.ErrInvalid. On MySQL
// its statements carry their arguments as the package's other statements
// do (see mysqlInline), so that a name reaches the same row in both.
func stdTxConn(op string, d *dialect, tx *sql.Tx) (conn, error) {
	if tx == nil {
		return nil, &fence.InvalidError{Op: op, Arg: "tx", Reason: "nil *sql.Tx"}
	}
	return stdConn{q: tx, inline: d == mysqlDialect}, nil
}

// pgxTxConn wraps the caller's pgx transaction on a database of dialect d;
// a nil tx, or a dialect other than PostgreSQL, returns an error matching
// fence.ErrInvalid.
func pgxTxConn(op string, d *dialect, tx pgx.Tx) (conn, error) {
	if d != postgresDialect {
		return nil, &fence.InvalidError{Op: op, Arg: "tx", Reason: fmt.Sprintf("a pgx transaction is on PostgreSQL, this database is %s", d.name)}
	}
	if p, ok := tx.(*pgxpool.Tx); tx == nil || ok && p == nil {
		return nil, &fence.InvalidError{Op: op, Arg: "tx", Reason: "nil pgx.Tx"}
	}
	return pgxConn{tx}, nil
}

func (g *Guards) wrap(err error) error {
	if sqliteDialect.missingTable(err) || postgresDialect.missingTable(err) || mysqlDialect.missingTable(err) {
		g.keys.forget() // it may be created again with another name column
		return &TableError{Table: g.table, DDL: g.ddl, Err: err}
	}
	if g.mysql {
		err = invalidTooLong(g.keys, err)
	}
	return fmt.Errorf("sqlfence: guard: %w", err)
}

// TxOptions configures RunTx. A nil *TxOptions means the defaults.
type TxOptions struct {
	// Isolation is the transaction's isolation level, one of database/sql's
	// levels; a value outside them is refused with an error matching
	// fence.ErrInvalid. Default: the server's.
	Isolation sql.IsolationLevel
	// MaxAttempts bounds how often the transaction runs when it fails with a
	// serialization failure or deadlock; a negative value is refused with an
	// error matching fence.ErrInvalid. Default (0): 10.
	MaxAttempts int
}

// RunTx runs f in a transaction on db (a *sql.DB) and commits it. RunPgxTx
// is the same for native pgx. When f or the
// commit fails with a PostgreSQL serialization failure or deadlock (40001,
// 40P01), or a MySQL deadlock or lock wait timeout (1213, 1205), the
// transaction is rolled back and run again from the start, at most
// MaxAttempts times in all; f must therefore have no effects outside tx. Any
// other error rolls back and is returned as it is (a fence.ErrStale from Guard
// among them). A nil ctx, db or f, or an option TxOptions refuses, returns an
// error matching fence.ErrInvalid before a transaction begins.
// A commit whose reply was lost (it may have committed) returns
// an error matching fence.ErrUnknown and is not run again. A caller who
// commits a guarded transaction itself gets the driver's error instead: an
// error other than one the server sent leaves the commit's outcome unknown.
// A panic in f rolls the transaction back and goes on to the caller. f must
// not commit or roll back tx itself: when it did, RunTx returns an error
// matching fence.ErrUnknown.
func RunTx(ctx context.Context, db *sql.DB, opts *TxOptions, f func(tx *sql.Tx) error) error {
	if err := checkRunTx("run tx", ctx, db == nil, f == nil); err != nil {
		return err
	}
	var o TxOptions
	if opts != nil {
		o = *opts
	}
	if o.Isolation < sql.LevelDefault || o.Isolation > sql.LevelLinearizable {
		return &fence.InvalidError{Op: "run tx", Arg: "Isolation", Reason: fmt.Sprintf("%d is not a database/sql isolation level", int(o.Isolation))}
	}
	attempts, err := maxAttempts("run tx", o.MaxAttempts)
	if err != nil {
		return err
	}
	return retryTx(ctx, attempts, func() error {
		tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: o.Isolation})
		if err != nil {
			return err
		}
		// A panic (or Goexit) in f rolls back on its way to the caller: a
		// transaction left open keeps its locks as long as its connection.
		ended := false
		defer func() {
			if !ended {
				_ = tx.Rollback()
			}
		}()
		err = f(tx)
		ended = true
		if err != nil {
			return errors.Join(err, tx.Rollback())
		}
		return commitErr(ctx, tx.Commit())
	})
}

// PgxBeginner is what *pgxpool.Pool and *pgx.Conn offer to begin a transaction.
type PgxBeginner interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// PgxTxOptions configures RunPgxTx. A nil *PgxTxOptions means the defaults.
type PgxTxOptions struct {
	// TxOptions begins each attempt's transaction (isolation level, access
	// mode). Its IsoLevel, AccessMode and DeferrableMode must each be empty
	// or one of pgx's constants (pgx puts them into the BEGIN statement as
	// they are), unless BeginQuery is set; others are refused with an error
	// matching fence.ErrInvalid. Default: the zero pgx.TxOptions, the
	// server's defaults.
	TxOptions pgx.TxOptions
	// MaxAttempts bounds how often the transaction runs when it fails with a
	// serialization failure or deadlock; a negative value is refused with an
	// error matching fence.ErrInvalid. Default (0): 10.
	MaxAttempts int
}

// RunPgxTx is RunTx for native pgx: it runs f in a transaction begun on db
// (a *pgxpool.Pool or a *pgx.Conn) and commits it, with the same guarantees
// and errors. When f or the commit fails with a serialization failure or
// deadlock (40001, 40P01), the transaction is rolled back and run again from
// the start, at most MaxAttempts times in all; f must therefore have no
// effects outside tx. A commit whose reply was lost returns an error matching
// fence.ErrUnknown and is not run again. A panic in f rolls the transaction
// back and goes on to the caller; f must not commit or roll back tx itself
// (when it did, RunPgxTx returns an error matching fence.ErrUnknown). A nil ctx, db or f, or an option
// PgxTxOptions refuses, returns an error matching fence.ErrInvalid before a
// transaction begins.
func RunPgxTx(ctx context.Context, db PgxBeginner, opts *PgxTxOptions, f func(tx pgx.Tx) error) error {
	if err := checkRunTx("run pgx tx", ctx, db == nil || isNilPgx(pgxBeginnerQuerier(db)), f == nil); err != nil {
		return err
	}
	var o PgxTxOptions
	if opts != nil {
		o = *opts
	}
	if err := checkPgxTxOptions(o.TxOptions); err != nil {
		return err
	}
	attempts, err := maxAttempts("run pgx tx", o.MaxAttempts)
	if err != nil {
		return err
	}
	return retryTx(ctx, attempts, func() error {
		tx, err := db.BeginTx(ctx, o.TxOptions)
		if err != nil {
			return err
		}
		ended := false // as in RunTx: a panic in f rolls back
		defer func() {
			if !ended {
				_ = tx.Rollback(context.WithoutCancel(ctx))
			}
		}()
		err = f(tx)
		ended = true
		if err != nil {
			return errors.Join(err, tx.Rollback(context.WithoutCancel(ctx)))
		}
		return commitErr(ctx, tx.Commit(ctx))
	})
}

// maxAttempts returns n, or the default 10 for 0; a negative n returns an
// error matching fence.ErrInvalid.
func maxAttempts(op string, n int) (int, error) {
	switch {
	case n < 0:
		return 0, &fence.InvalidError{Op: op, Arg: "MaxAttempts", Reason: fmt.Sprintf("%d is negative (0 means the default, 10)", n)}
	case n == 0:
		return 10, nil
	}
	return n, nil
}

// checkPgxTxOptions refuses transaction modes that are not pgx's constants:
// pgx writes them into BEGIN unchecked, so a typo is a syntax error at run
// time and anything after a semicolon another statement. A BeginQuery
// replaces them, and is the caller's own SQL.
func checkPgxTxOptions(o pgx.TxOptions) error {
	if o.BeginQuery != "" {
		return nil
	}
	for _, f := range []struct {
		arg, v string
		ok     []string
	}{
		{"TxOptions.IsoLevel", string(o.IsoLevel), []string{string(pgx.Serializable), string(pgx.RepeatableRead), string(pgx.ReadCommitted), string(pgx.ReadUncommitted)}},
		{"TxOptions.AccessMode", string(o.AccessMode), []string{string(pgx.ReadWrite), string(pgx.ReadOnly)}},
		{"TxOptions.DeferrableMode", string(o.DeferrableMode), []string{string(pgx.Deferrable), string(pgx.NotDeferrable)}},
	} {
		if f.v != "" && !slices.Contains(f.ok, f.v) {
			return &fence.InvalidError{Op: "run pgx tx", Arg: f.arg, Reason: fmt.Sprintf("%q is not one of pgx's constants", f.v)}
		}
	}
	return nil
}

// checkRunTx refuses a nil context, handle or function with an error
// matching fence.ErrInvalid, before a transaction begins.
func checkRunTx(op string, ctx context.Context, nilDB, nilF bool) error {
	if err := leasekit.CheckContext(op, ctx); err != nil {
		return err
	}
	if nilDB {
		return &fence.InvalidError{Op: op, Arg: "db", Reason: "nil database handle"}
	}
	if nilF {
		return &fence.InvalidError{Op: op, Arg: "f", Reason: "nil function"}
	}
	return nil
}

// pgxBeginnerQuerier returns db as a PgxQuerier when it is one of pgx's
// handle types, for isNilPgx.
func pgxBeginnerQuerier(db PgxBeginner) PgxQuerier {
	q, _ := db.(PgxQuerier)
	return q
}

// commitErr reports a commit that failed without a reply from the server (a
// lost reply, a cut connection) as fence.ErrUnknown: it may have committed.
// Such a transaction is not run again.
//
// A transaction already ended while ctx is live was ended by f itself, which
// may have committed it: that is fence.ErrUnknown too. (When ctx ended,
// database/sql rolled the transaction back, and the error stays definite.)
func commitErr(ctx context.Context, err error) error {
	if err == nil {
		return nil
	}
	if ctx.Err() == nil && (errors.Is(err, sql.ErrTxDone) || errors.Is(err, pgx.ErrTxClosed)) {
		return fmt.Errorf("sqlfence: commit: %w: f ended the transaction itself (committed or rolled back it), so RunTx cannot tell which: %w", fence.ErrUnknown, err)
	}
	return unknownIfAmbiguous(fmt.Errorf("sqlfence: commit: %w", err), false)
}

// retryTx runs once until it returns something other than a serialization
// failure, at most attempts times.
func retryTx(ctx context.Context, attempts int, once func() error) error {
	var err error
	for i := 0; i < attempts; i++ {
		if i > 0 && !retryPause(ctx, i-1) {
			return errors.Join(err, ctx.Err())
		}
		if err = once(); !IsSerializationFailure(err) && !IsMySQLRetryable(err) {
			return err
		}
	}
	return fmt.Errorf("sqlfence: transaction failed %d times with a serialization failure: %w", attempts, err)
}
