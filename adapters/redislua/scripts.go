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
	//go:embed scripts/bump.lua
	bumpLua string
	//go:embed scripts/idem_begin.lua
	idemBeginLua string
	//go:embed scripts/idem_update.lua
	idemUpdateLua string
	//go:embed scripts/idem_get.lua
	idemGetLua string
	//go:embed scripts/redlock_lock.lua
	redlockLockLua string
	//go:embed scripts/redlock_raise.lua
	redlockRaiseLua string
	//go:embed scripts/redlock_release.lua
	redlockReleaseLua string

	lockScript  = redis.NewScript(lockLua)
	renewScript = redis.NewScript(renewLua)
	writeScript = redis.NewScript(writeLua)
	readScript  = redis.NewScript(readLua)

	bumpScript           = redis.NewScript(bumpLua)
	idemBeginScript      = redis.NewScript(idemBeginLua)
	idemUpdateScript     = redis.NewScript(idemUpdateLua)
	idemGetScript        = redis.NewScript(idemGetLua)
	redlockLockScript    = redis.NewScript(redlockLockLua)
	redlockRaiseScript   = redis.NewScript(redlockRaiseLua)
	redlockReleaseScript = redis.NewScript(redlockReleaseLua)
)

// fencedBody returns the fenced wrapper around a user's script body.
func fencedBody(body string) string { return strings.Replace(fencedLua, "--BODY--", body, 1) }
