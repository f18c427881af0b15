// Package sqlfence fences rows in SQL databases and grants leases from a lease
// table, on SQLite (modernc.org/sqlite, no cgo) and PostgreSQL.
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
package sqlfence
