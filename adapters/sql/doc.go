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
//     is decided on the database server's clock.
//
// # Schema
//
// The tables are created by [Writer.CreateTable] and [Acquirer.CreateTable], or
// by hand from [Writer.DDL] and [Acquirer.DDL]. Never delete rows from the lease
// table: a row holds its name's token counter, and deleting it would restart the
// counter at 1 and hand out tokens that were already used.
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
// for byte. Expiry is the server's NOW(3). Across a primary failover, leases
// and counters are as durable as the replication: with asynchronous
// replication, the new primary can lack the last grants and hand out their
// tokens again, so use semi-synchronous replication (or Group Replication)
// where tokens must survive a failover. Guards for MySQL are made with
// GuardOptions.MySQL (or use [MySQLGuard]); under REPEATABLE READ, MySQL's
// default, and READ COMMITTED alike, a guard takes the row lock and reads the
// latest committed fence, and [RunTx] runs a transaction again after a
// deadlock (1213) or lock wait timeout (1205).
package sqlfence
