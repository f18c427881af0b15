-- The lease of one name, with a line of waiters from any process.
-- KEYS[1] the lock key (value nonce:token), KEYS[2] the token counter,
-- KEYS[3] the line (a list of waiter nonces, oldest first). Each waiter has
-- an entry key, KEYS[1] without ":lock" plus ":w:" and its nonce, holding
-- "acquirer stamp ttl_ms floor" and expiring unless the waiter refreshes it.
-- All share the hash tag {name}, so one Cluster slot.
-- ARGV[1] the operation: "try", "wait", "release" or "leave".
-- ARGV[2] the caller's nonce ("release": the holder's lock value).
-- ARGV[3] the ttl in ms ("release" and "leave": how long the caller's nonce
-- stays marked gone), ARGV[4] "1" to raise tokens to the server clock in µs,
-- ARGV[5] the caller's acquirer id, ARGV[6] the caller's stamp (opaque),
-- ARGV[7] how long a waiter's entry lives without a refresh, in ms,
-- ARGV[8] the lock name, ARGV[9] the grant channel prefix (+ acquirer id),
-- ARGV[10] "1" when PUBLISH's receiver count shows whether an acquirer listens,
-- ARGV[11] how long the line lives after the last waiter's poll, in ms,
-- ARGV[12] "1" when the caller's acquirer has HeadSpin: a grant it makes
-- tells the waiter then first in line that it is next, if that one spins.
--
-- Reply: {code, number, [nonce, token, stamp, acquirer]} where the last four
-- describe a grant this call made to a waiter (the head of the line).
--   try/wait: code 1 = granted to the caller (number: token);
--             code 0 = held; "wait" has queued the caller.
--   release:  code 0 = not the holder; 1 = released; 2 = handed to a waiter.
--   leave:    code 0 = left the line; 3 = the caller had been granted the lock
--             (number: that token), and released it.
-- A grant to a waiter of another acquirer is published on its channel
-- (nonce token stamp name); one to the caller's own acquirer is only in the
-- reply. A waiter whose entry expired is dropped from the line; one whose
-- acquirer does not listen (ARGV[10]: its subscription is reconnecting, or
-- its process died) misses this grant, which goes to the next waiter, but
-- keeps its place; a dead waiter's entry expires and it is dropped then.
local lock, counter, line = KEYS[1], KEYS[2], KEYS[3]
local op, me, acq = ARGV[1], ARGV[2], ARGV[5]
local entry_base = string.sub(lock, 1, #lock - 5) .. ':w:'
-- A nonce whose lease was released, or whose waiter left, is marked gone for
-- the ttl: a "try" or "wait" of it that lands late (sent before, delayed on
-- the way, or sent again by the client) must not lock the name for a ttl.
local gone_base = string.sub(lock, 1, #lock - 5) .. ':gone:'

local function next_token(floor)
  local n = 0
  local cur = redis.call('GET', counter)
  if cur then
    n = tonumber(cur)
    if not n or n < 0 or n ~= math.floor(n) then
      return nil, redis.error_reply('fencekit: token counter ' .. counter .. ' holds ' .. cur .. ', not a token')
    end
  end
  local tok = n + 1
  if floor then
    local t = redis.call('TIME')
    local f = tonumber(t[1]) * 1000000 + tonumber(t[2])
    if f > tok then tok = f end
  end
  if tok > 9007199254740991 then
    return nil, redis.error_reply('fencekit: token counter ' .. counter .. ' exhausted')
  end
  return string.format('%d', tok)
end

local function set_lock(nonce, tok, ttl)
  redis.call('SET', counter, tok)
  redis.call('SET', lock, nonce .. ':' .. tok, 'PX', ttl)
end

-- grant_head gives the free lock to the first live waiter in line. Waiters
-- nobody heard go back to the head of the line, in their order.
local function grant_head()
  local unheard, g, err = {}, nil, nil
  while true do
    local n = redis.call('LPOP', line)
    if not n then break end
    local e = redis.call('GET', entry_base .. n)
    if e then
      local wacq, stamp, ttl, floor = string.match(e, '^(%S+) (%S+) (%S+) (%S+)$')
      if wacq then
        local tok
        tok, err = next_token(floor == '1' or ARGV[4] == '1')
        if not tok then break end
        local heard = 1
        if wacq ~= acq then
          -- pcall: a caller whose Redis user may not publish there (ACL
          -- channels) counts the waiter unheard instead of failing half-way.
          heard = redis.pcall('PUBLISH', ARGV[9] .. wacq, n .. ' ' .. tok .. ' ' .. stamp .. ' ' .. ARGV[8])
          if type(heard) ~= 'number' then heard = 0 end
        end
        if heard > 0 or ARGV[10] ~= '1' then
          redis.call('DEL', entry_base .. n)
          set_lock(n, tok, ttl)
          g = {n, tok, stamp, wacq}
          break
        end
        table.insert(unheard, n)
      else
        redis.call('DEL', entry_base .. n)
      end
    end
  end
  for i = #unheard, 1, -1 do redis.call('LPUSH', line, unheard[i]) end
  if #unheard > 0 then redis.call('PEXPIRE', line, ARGV[11]) end
  -- The waiter now first in line is told so when it asked (its stamp ends
  -- with "s": it spins while it is next, see AcquirerOptions.HeadSpin), by
  -- an acquirer that spins too (the others spend no command on it).
  if g and ARGV[12] == '1' then
    local n2 = redis.call('LINDEX', line, 0)
    local e2 = n2 and redis.call('GET', entry_base .. n2)
    if e2 then
      local wacq2, stamp2 = string.match(e2, '^(%S+) (%S+) ')
      if wacq2 and string.sub(stamp2, -1) == 's' then
        redis.pcall('PUBLISH', ARGV[9] .. wacq2, 'next ' .. n2)
      end
    end
  end
  return g, err
end

local function reply(code, number, g)
  if g then return {code, number, g[1], g[2], g[3], g[4]} end
  return {code, number}
end

-- enqueue puts the caller at the end of the line, or refreshes its entry and
-- the line's expiry. The line expires ARGV[11] ms after the last poll of any
-- waiter: by then only entries of waiters that died can be in it, and grants
-- drop those. A waiter whose line expired anyway (a poll later than that)
-- joins the new line at its end.
local function enqueue()
  local e = acq .. ' ' .. ARGV[6] .. ' ' .. ARGV[3] .. ' ' .. ARGV[4]
  if not redis.call('SET', entry_base .. me, e, 'PX', ARGV[7], 'GET') or redis.call('EXISTS', line) == 0 then
    redis.call('RPUSH', line, me)
  end
  redis.call('PEXPIRE', line, ARGV[11])
end

local function leave_line()
  if redis.call('DEL', entry_base .. me) == 1 then
    redis.call('LREM', line, 1, me)
  end
end

if op == 'try' or op == 'wait' then
  if redis.call('EXISTS', gone_base .. me) == 1 then
    return reply(0, 0)
  end
  local cur = redis.call('GET', lock)
  if cur and string.sub(cur, 1, #me + 1) == me .. ':' then
    -- Granted to this waiter already (its message may be on the way, or
    -- lost): the lease counts from this call.
    redis.call('PEXPIRE', lock, ARGV[3])
    return reply(1, string.sub(cur, #me + 2))
  end
  if cur then
    if op == 'wait' then enqueue() end
    return reply(0, 0)
  end
  -- Free: the line goes first (the caller's own entry counts from now).
  if op == 'wait' and redis.call('EXISTS', entry_base .. me) == 1 then enqueue() end
  local g, err = grant_head()
  if err then return err end
  if g and g[1] == me then
    return reply(1, g[2])
  end
  if g then
    if op == 'wait' then enqueue() end
    return reply(0, 0, g)
  end
  -- A "try" caller was never in line; a "wait" caller still is only if the
  -- line list expired under its entry.
  if op == 'wait' then leave_line() end
  local tok, err2 = next_token(ARGV[4] == '1')
  if not tok then return err2 end
  set_lock(me, tok, ARGV[3])
  return reply(1, tok)
elseif op == 'release' then
  local nonce = string.match(me, '^(.+):%d+$')
  if nonce then redis.call('SET', gone_base .. nonce, '1', 'PX', ARGV[3]) end
  if redis.call('GET', lock) ~= me then
    return reply(0, 0)
  end
  redis.call('DEL', lock)
  local g, err = grant_head()
  if err then return err end
  if g then return reply(2, 0, g) end
  return reply(1, 0)
elseif op == 'leave' then
  redis.call('SET', gone_base .. me, '1', 'PX', ARGV[3])
  leave_line()
  local cur = redis.call('GET', lock)
  if cur and string.sub(cur, 1, #me + 1) == me .. ':' then
    redis.call('DEL', lock)
    local g, err = grant_head()
    if err then return err end
    return reply(3, string.sub(cur, #me + 2), g)
  end
  return reply(0, 0)
end
return redis.error_reply('fencekit: unknown lock operation ' .. tostring(op))
