-- Run a user's script body only when the token passes the fence.
-- KEYS[1] the fence key (a string holding the largest token accepted), then the
-- body's own keys; ARGV[1] the token, then the body's own arguments.
-- Returns {1, the body's result} when it ran, {0, current} when the fence holds a
-- larger token (the body did not run).
local fenceKey, tok = KEYS[1], tonumber(ARGV[1])
local cur = redis.call('GET', fenceKey)
if cur then
  local c = tonumber(cur)
  if not c then
    return redis.error_reply('fencekit: fence ' .. fenceKey .. ' holds ' .. cur .. ', not a token')
  end
  if c > tok then
    return {0, cur}
  end
end
-- Raise the fence before the body runs: Redis keeps the writes of a body that
-- fails half-way, and those writes must be fenced at this token like any other.
if not cur or tonumber(cur) < tok then
  redis.call('SET', fenceKey, ARGV[1])
end
local result = (function(KEYS, ARGV)
--BODY--
end)({select(2, unpack(KEYS))}, {select(2, unpack(ARGV))})
return {1, result}
