-- Redlock phase 1 on one node: take the lock if free, and report the counter.
-- KEYS[1] the lock key, KEYS[2] the token counter, KEYS[3] this grant's
-- release mark (set by redlock_release.lua); ARGV[1] the holder's nonce,
-- ARGV[2] the ttl in ms. Returns {1, counter} when taken (or already taken by
-- this grant: a call sent again after a lost reply), {0, counter} when
-- held, or when this grant was already released here: a lock call that lands
-- after its grant's release must not lock the node for a ttl.
-- The counter reported is never below the node's clock (TIME) in
-- microseconds, so a counter that was deleted (DEL, FLUSHALL, eviction) does
-- not make the next token restart at 1.
local n = 0
local cur = redis.call('GET', KEYS[2])
if cur then
  n = tonumber(cur)
  if not n or n < 0 or n ~= math.floor(n) then
    return redis.error_reply('fencekit: token counter ' .. KEYS[2] .. ' holds ' .. cur .. ', not a token')
  end
end
local t = redis.call('TIME')
local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
if us > n then
  n = us
end
local s = string.format('%d', n)
if redis.call('EXISTS', KEYS[3]) == 1 then
  return {0, s}
end
-- Taken by this grant already: this is the call sent again by the client
-- after its first reply was lost.
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  return {1, s}
end
if holder then
  return {0, s}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {1, s}
