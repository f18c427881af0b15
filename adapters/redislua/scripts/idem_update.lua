-- Compare-and-set an idempotency record on (state, fence).
-- KEYS[1] the record. ARGV: [1] from state, [2] from fence, [3] new state,
-- [4] new fence, [5] owner, [6] lease ms, [7] "1" to restart the in-progress
-- clock, [8] retention ms (0: none), [9] result, [10] "1" if the result was
-- dropped, [11] "1" to store the result, [12] channel, [13] message,
-- [14] ms to keep a released record.
-- Returns {1, record...}, {-1} for no record, {-2, fence} for another fence,
-- {-3, state} for another state.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return {-1} end
local fence = redis.call('HGET', KEYS[1], 'fence')
if tonumber(fence) ~= tonumber(ARGV[2]) then return {-2, fence} end
if state ~= ARGV[1] then return {-3, state} end
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'fence', ARGV[4], 'owner', ARGV[5],
  'lease_until', string.format('%d', now + tonumber(ARGV[6])), 'dropped', ARGV[10])
if ARGV[7] == '1' then redis.call('HSET', KEYS[1], 'started', string.format('%d', now)) end
if ARGV[11] == '1' then redis.call('HSET', KEYS[1], 'result', ARGV[9]) else redis.call('HDEL', KEYS[1], 'result') end
local keep = tonumber(ARGV[8])
if ARGV[3] == 'released' then keep = tonumber(ARGV[14]) end
if keep > 0 then
  redis.call('HSET', KEYS[1], 'expires', string.format('%d', now + keep))
  -- Redis removes the record itself once it is past its retention.
  redis.call('PEXPIRE', KEYS[1], keep)
else
  redis.call('HDEL', KEYS[1], 'expires')
  redis.call('PERSIST', KEYS[1])
end
-- pcall: the record has changed by now; a Redis user that may not publish on
-- the channel (ACL channels) must not get an error for a change Redis kept.
-- Waiters in Do poll as well, and find the change then.
if ARGV[3] ~= 'claimed' and ARGV[3] ~= 'armed' then redis.pcall('PUBLISH', ARGV[12], ARGV[13]) end
local h = redis.call('HMGET', KEYS[1], 'fp', 'state', 'fence', 'owner', 'lease_until', 'started', 'result', 'dropped')
return {1, h[1], h[2], h[3], h[4], tostring(tonumber(h[5]) - now), tostring(now - tonumber(h[6])), h[7], h[8]}
