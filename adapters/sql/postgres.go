package sqlfence

import (
	"errors"

	"github.com/jackc/pgx/v5/pgconn"
)

var postgresDialect = &dialect{
	name:     "postgres",
	nowMs:    "(extract(epoch FROM clock_timestamp()) * 1000)::bigint",
	textType: "TEXT", blobType: "BYTEA", intType: "BIGINT",
	missingTable:        func(err error) bool { return pgCode(err) == "42P01" },
	checkViolation:      func(err error) bool { return pgCode(err) == "23514" },
	serializationFailed: func(err error) bool { c := pgCode(err); return c == "40001" || c == "40P01" },
}

func pgCode(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}
