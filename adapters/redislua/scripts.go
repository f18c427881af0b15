package redislua

import (
	_ "embed"
	"strings"

	"github.com/redis/go-redis/v9"
)

var (
	//go:embed scripts/lock.lua
	lockLua string
	//go:embed scripts/renew.lua
	renewLua string
	//go:embed scripts/write.lua
	writeLua string
	//go:embed scripts/read.lua
	readLua string
	//go:embed scripts/fenced.lua
	fencedLua string

	lockScript  = redis.NewScript(lockLua)
	renewScript = redis.NewScript(renewLua)
	writeScript = redis.NewScript(writeLua)
	readScript  = redis.NewScript(readLua)
)

// fencedBody returns the fenced wrapper around a user's script body.
func fencedBody(body string) string { return strings.Replace(fencedLua, "--BODY--", body, 1) }
