// Package sqlfence fences rows in SQL databases and grants leases from a lease
// table, on SQLite (modernc.org/sqlite, no cgo), PostgreSQL, and MySQL 8 or
// MariaDB 10.5+ (github.com/go-sql-driver/mysql).
//
// Every check and write is one SQL statement, so the database decides it
// atomically:
//
//   - [Writer] stores a value and its fence in one row per key with an upsert
//     whose update only applies when the stored fence is not larger than the
//     offered token. A fenced delete leaves a tombstone (value NULL, fence kept).
//   - [Acquirer] grants leases from a lease table. The token is a per-name
//     counter advanced by the same statement that grants the lease, and expiry
//     is decided on the database server's clock. A renewal asked for after the
//     lease's local deadline returns fence.ErrLost and does not extend it.
//
// # Schema
//
// Every type with a table is made on a [DB] (NewWriter, NewAcquirer,
// NewGuards, NewIdempotencyStore) and creates its table there with its
// CreateTable(ctx) method ([Writer.CreateTable], [Acquirer.CreateTable],
// [Guards.CreateTable], [IdempotencyStore.CreateTable]), or an operator runs
// its DDL by hand. A lease row holds its name's
// token counter. A new row starts its counter at the database server's clock
// in microseconds since the Unix epoch, so a row that is deleted anyway (an
// operator's DELETE, a restored backup) does not hand out tokens that were
// already used, as long as the server's clock has not stepped back past the
// old row's creation and no Bump raised the old counter above the clock (see
// [Acquirer]). Do not delete writer or guard rows: they are the fences.
//
// # Names and keys
//
// Keys, lock names and idempotency keys are compared byte for byte on every
// dialect: case, trailing spaces, Unicode normalisation (NFC and NFD) and
// 4-byte characters make different names. On MySQL this holds under every
// connection character set and sql_mode the driver can be given (utf8mb3,
// latin1, a non-strict mode, interpolateParams, MariaDB's
// EMPTY_STRING_IS_NULL): every text argument reaches the statements as bytes.
// On MySQL the package's own statements carry their arguments as literals
// (bytes as X'…' hex, integers in decimal), one round trip each, where the
// driver would prepare them first without interpolateParams; a value over 4
// KiB, or the bytes of a statement over the connection's packet limit, go as
// parameters in base64 that the server decodes (a text parameter would be
// converted to the connection's character set), so a parameter takes 4/3 of
// its size out of max_allowed_packet. Guard and CompleteTx send theirs the
// same way in the caller's transaction.
// A table of your own given to [NewWriter], [NewGuards], [NewAcquirer] or
// [NewIdempotencyStore] on MySQL must have a key column that compares bytes:
// VARBINARY, or VARCHAR with a NO PAD binary collation (utf8mb4_nopad_bin, or
// utf8mb4_0900_bin on MySQL 8). A case-insensitive or PAD SPACE collation
// (utf8mb4_bin among them), CHAR or BINARY would make two keys one row: the
// first statement on such a table returns an error matching fence.ErrInvalid
// that names the column. A key longer than the column holds (which a
// non-strict sql_mode would cut) is refused the same way. The column is read
// on first use, and again after the table was found missing or a write or
// guard met a row that is not its key's own; a table re-created with another
// column is refused from that write on.
//
// # Lost replies
//
// A statement whose reply was lost (a cut connection, a timeout while it ran)
// may have been applied. Write, Delete, Bump and the idempotency store's Begin
// and Update then return an error matching fence.ErrUnknown (the driver's
// error stays in the chain), as do RunTx and RunPgxTx for a commit. The lease
// steps recognise their own work instead: a grant carries a nonce of its call
// and is adopted when found, a renewal runs again, a release recognises its own
// applied release; only when they cannot know after a few attempts do they
// return fence.ErrUnknown (Acquire keeps trying until its context ends).
// An error the server sent, an SQLite error, a connection that could not be
// opened (a refused dial, pgconn's ConnectError), a call whose context ended
// while it waited for a connection of the pool (its error matches the
// context's), and a driver error for a request that was not sent
// (driver.ErrBadConn, run again on another connection) are reported as they
// are.
//
// # SQLite
//
// Open the database with [OpenSQLite], which sets WAL mode and a busy timeout so
// that several processes on one machine can share the file. Leases and fences are
// then safe across those processes: each grant, renewal, release and fenced write
// is a single statement that SQLite runs under its write lock.
//
// # MySQL and MariaDB
//
// Wrap the handle with [MySQL]. MySQL has neither RETURNING nor an upsert with
// a condition, and its rows-affected count says 0 for a matched row whose
// values did not change (1 with clientFoundRows), so a count cannot tell a
// refused write from an equal token writing equal bytes. The MySQL statements
// are therefore written apart, built once when an Acquirer, Writer, Guards or
// IdempotencyStore is made, and each reports its decision through
// LAST_INSERT_ID(expr): the token (or new fence) when it made its change, 0
// when it did not, read from the same statement's reply. A grant is one
// INSERT ... ON DUPLICATE KEY UPDATE whose assignments test the old expiry; a
// write to an existing key is one fenced UPDATE (a new key takes a second
// statement, the upsert). Keys and names are VARBINARY(1024), compared byte
// for byte. Expiry is the server's clock read as a UTC count
// (UTC_TIMESTAMP(6)), whatever the session's time_zone. Across a primary failover, leases
// and counters are as durable as the replication: with asynchronous
// replication, the new primary can lack the last grants and hand out their
// tokens again, so use semi-synchronous replication (or Group Replication)
// where tokens must survive a failover. Guards made on a MySQL [DB] use MySQL's
// statements; under REPEATABLE READ, MySQL's
// default, and READ COMMITTED alike, a guard takes the row lock and reads the
// latest committed fence, and [RunTx] runs a transaction again after a
// deadlock (1213) or lock wait timeout (1205).
package sqlfence
