-- A fenced write: value and fence in one hash.
-- KEYS[1] the hash; ARGV[1] the value, ARGV[2] the token, ARGV[3] "1" to delete
-- (keep the fence, drop the value: a tombstone).
-- Returns {1} when written, {0, current} when the hash holds a larger token.
local tok = tonumber(ARGV[2])
local cur = redis.call('HGET', KEYS[1], 'f')
if cur then
  local c = tonumber(cur)
  if not c then
    return redis.error_reply('fencekit: fence of ' .. KEYS[1] .. ' holds ' .. cur .. ', not a token')
  end
  if c > tok then
    return {0, cur}
  end
end
if ARGV[3] == '1' then
  redis.call('HDEL', KEYS[1], 'v')
  redis.call('HSET', KEYS[1], 'f', ARGV[2])
else
  redis.call('HSET', KEYS[1], 'f', ARGV[2], 'v', ARGV[1])
end
return {1}
