package fence

import "fmt"

// Token is a fencing token. For one lock name, every grant's token is larger than
// every earlier grant's token. Valid tokens are 1..MaxToken; 0 is never granted.
// Tokens never wrap: once a name's counter reaches MaxToken, its acquirer refuses
// to grant it with an error matching ErrTokensExhausted.
type Token uint64

// MaxToken is the largest token any backend grants: 2^53-1. It fits a PostgreSQL
// BIGINT and is exact as a Lua (double) number, so every backend compares tokens
// exactly. An acquirer whose counter would pass it refuses to grant, with an
// error matching ErrTokensExhausted.
const MaxToken Token = 1<<53 - 1

// String formats the token as a decimal number.
func (t Token) String() string { return fmt.Sprintf("%d", uint64(t)) }

// Valid reports whether t is in 1..MaxToken.
func (t Token) Valid() bool { return t >= 1 && t <= MaxToken }
