-- Claim an idempotency key, or report its record.
-- KEYS[1] the record (a hash); ARGV[1] fingerprint, ARGV[2] owner, ARGV[3] lease ms.
-- Returns {created (1/0), record...}: see record() below.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function record()
  local h = redis.call('HMGET', KEYS[1], 'fp', 'state', 'fence', 'owner', 'lease_until', 'started', 'result', 'dropped')
  return {h[1], h[2], h[3], h[4], tostring(tonumber(h[5]) - now), tostring(now - tonumber(h[6])), h[7], h[8]}
end
local state = redis.call('HGET', KEYS[1], 'state')
local fence = 0
if state then
  local exp = tonumber(redis.call('HGET', KEYS[1], 'expires') or '')
  if state ~= 'released' and not (exp and exp <= now) then
    local r = record()
    table.insert(r, 1, 0)
    return r
  end
  fence = tonumber(redis.call('HGET', KEYS[1], 'fence'))
end
-- A fence is never below the server's clock in microseconds when it was
-- granted, so a key whose record expired starts again above every fence it had.
local floor = tonumber(t[1]) * 1000000 + tonumber(t[2])
fence = math.max(fence + 1, floor)
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'state', 'claimed', 'fence', string.format('%d', fence), 'owner', ARGV[2],
  'lease_until', string.format('%d', now + tonumber(ARGV[3])), 'started', string.format('%d', now), 'dropped', '0')
local r = record()
table.insert(r, 1, 1)
return r
