-- Redlock phase 2 on one node: while this holder still has the lock here, raise
-- the counter to the chosen token (never lower it).
-- KEYS[1] the lock key, KEYS[2] the token counter; ARGV[1] the nonce, ARGV[2] the token.
-- Returns 1 when the lock is still this holder's (the counter is now >= token), else 0.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local cur = tonumber(redis.call('GET', KEYS[2]) or '0')
if cur < tonumber(ARGV[2]) then
  redis.call('SET', KEYS[2], ARGV[2])
end
return 1
