-- Release a lease if this grant still holds it, and tell the waiters.
-- KEYS[1] the lock key; ARGV[1] the grant's lock value, ARGV[2] the release
-- channel, ARGV[3] the lock name (the message).
-- Returns 1 when released, 0 when the lease was no longer this grant's.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], ARGV[3])
  return 1
end
return 0
