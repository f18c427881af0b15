-- Raise a token counter, never lower it.
-- KEYS[1] the counter; ARGV[1] the new value.
-- Returns {1, new} when raised, {0, current} when already at or above it.
local cur = redis.call('GET', KEYS[1])
local n = 0
if cur then
  n = tonumber(cur)
  if not n then
    return redis.error_reply('fencekit: token counter ' .. KEYS[1] .. ' holds ' .. cur .. ', not a token')
  end
end
if n >= tonumber(ARGV[1]) then
  return {0, string.format('%d', n)}
end
redis.call('SET', KEYS[1], ARGV[1])
return {1, ARGV[1]}
