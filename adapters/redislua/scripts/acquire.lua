-- Grant a lease and its token in one step.
-- KEYS[1] the lock key, KEYS[2] the name's token counter (same hash slot).
-- ARGV[1] the new holder's nonce, ARGV[2] the ttl in milliseconds,
-- ARGV[3] "1" to raise the token to the server clock in microseconds (the floor),
-- ARGV[4] empty for a plain grant, or the lock value of the current holder to
-- hand the lease over from it (it must still hold the lock).
-- Returns {1, token} when granted, {0, pttl} when the lock is held, and
-- {-1, 0} when a hand-over finds the lock no longer the current holder's.
if ARGV[4] ~= '' then
  if redis.call('GET', KEYS[1]) ~= ARGV[4] then
    return {-1, 0}
  end
elseif redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, redis.call('PTTL', KEYS[1])}
end
local n = 0
local cur = redis.call('GET', KEYS[2])
if cur then
  n = tonumber(cur)
  if not n or n < 0 or n ~= math.floor(n) then
    return redis.error_reply('fencekit: token counter ' .. KEYS[2] .. ' holds ' .. cur .. ', not a token')
  end
end
local tok = n + 1
if ARGV[3] == '1' then
  local t = redis.call('TIME')
  local floor = tonumber(t[1]) * 1000000 + tonumber(t[2])
  if floor > tok then tok = floor end
end
if tok > 9007199254740991 then
  return redis.error_reply('fencekit: token counter ' .. KEYS[2] .. ' exhausted')
end
local s = string.format('%d', tok)
redis.call('SET', KEYS[2], s)
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. s, 'PX', ARGV[2])
return {1, s}
