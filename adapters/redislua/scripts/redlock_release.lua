-- Redlock release on one node: delete the lock if this grant holds it, and
-- mark the grant released for a ttl, so that its lock call, if it lands here
-- later (sent before the release, delayed on the way), is refused.
-- KEYS[1] the lock key, KEYS[2] the grant's release mark; ARGV[1] the nonce,
-- ARGV[2] the ttl in ms. Returns 1 when this grant held the lock here, else 0.
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
