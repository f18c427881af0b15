-- Extend a lease if this grant still holds it.
-- KEYS[1] the lock key; ARGV[1] the grant's lock value, ARGV[2] the ttl in ms.
-- Returns 1 when extended, 0 when the lease is no longer this grant's.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
