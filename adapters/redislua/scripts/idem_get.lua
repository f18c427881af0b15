-- KEYS[1] the record. Returns the record (as idem_begin's record()), or {} if none.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
local h = redis.call('HMGET', KEYS[1], 'fp', 'state', 'fence', 'owner', 'lease_until', 'started', 'result', 'dropped')
return {h[1], h[2], h[3], h[4], tostring(tonumber(h[5]) - now), tostring(now - tonumber(h[6])), h[7], h[8]}
