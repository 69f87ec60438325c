-- Keyed rate limits (rate-limits.md RL-1..RL-4), prepended after lib.lua to every locket script
-- by src/store/scripts.rs. Nothing here touches a key on its own.
--
-- <prefix>rate:<key>         ZSET, the key's sliding log: member = the start's reservation id,
--                            score = its start (Redis TIME, ms). At most `limit` members (the
--                            oldest go as new ones come), expiring one period after the last
--                            start (RL-1).
-- <prefix>rate_closed:<key>  STRING, the ms until which the key is closed by a handler's
--                            back-off (RL-4), with PX to that time.
-- <prefix>parked:rate:<key>  the parked list of the jobs it refused (RL-3, lib.lua's
--                            parked_wake), indexed in <prefix>parked as "rate:<key>" with the
--                            time its next start is allowed.
--
-- A rate `r` is {key, limit, period ms, spread (0 or 1)}, as ACQUIRE's options carry it.

-- The log of `key` as a LOCKET_STORE error when it holds another type (nothing written).
local function rate_wrongtype(step, rk)
  local t = redis.pcall('TYPE', rk)
  t = type(t) == 'table' and t['ok'] or '?'
  error({err = 'LOCKET_STORE ' .. step .. ': WRONGTYPE ' .. rk .. ' holds a ' .. t ..
    ', not a zset; nothing was changed'})
end

-- RL-1: when the next start of rate `r` is allowed (ms, Redis clock; <= now: allowed now), and
-- whether its log is full (it holds `limit` starts, so a start drops the oldest). The log's
-- `limit`-th newest start (one ZRANGE) bounds any sliding window: a start is allowed once it is
-- a period old. With spread, the newest must also be period/limit old. Reads only; raises a
-- LOCKET_STORE error (before any write of the step, S-6) when the log holds another type.
local function rate_allowed_at(prefix, r, now, step)
  local key, limit, period = r[1], tonumber(r[2]), tonumber(r[3])
  local rk = prefix .. 'rate:' .. key
  local at = now
  local closed = tonumber(sget(prefix .. 'rate_closed:' .. key) or '')
  if closed and closed > at then at = closed end
  local nth = redis.pcall('ZRANGE', rk, -limit, -limit, 'WITHSCORES')
  if type(nth) ~= 'table' or nth.err then rate_wrongtype(step, rk) end
  local full = #nth > 0
  if full and tonumber(nth[2]) + period > at then at = tonumber(nth[2]) + period end
  if r[4] == 1 or r[4] == true then
    local last = nth
    if limit > 1 then last = redis.call('ZRANGE', rk, -1, -1, 'WITHSCORES') end
    if #last > 0 then
      local t = tonumber(last[2]) + math.ceil(period / limit)
      if t > at then at = t end
    end
  end
  return at, full
end

-- RL-1: records a start of rate `r` at `now` (its allowed_at said yes, in the same step).
local function rate_record(prefix, r, now, member, full)
  local rk = prefix .. 'rate:' .. r[1]
  redis.call('ZADD', rk, int(now), member)
  if full then redis.call('ZREMRANGEBYRANK', rk, 0, -(tonumber(r[2]) + 1)) end
  redis.call('PEXPIRE', rk, int(r[3]))
end

-- RL-3, RL-5: how many starts `r` allows now, when the next one is allowed (ms), and the
-- starts in the window now; nil when its log holds another type.
local function rate_free(prefix, r, now)
  local key, limit, period = r[1], tonumber(r[2]), tonumber(r[3])
  local rk = prefix .. 'rate:' .. key
  local closed = tonumber(sget(prefix .. 'rate_closed:' .. key) or '')
  if closed and closed > now then return 0, closed, 0 end
  local used = redis.pcall('ZCOUNT', rk, '(' .. int(now - period), '+inf')
  if type(used) ~= 'number' then return nil, now, 0 end
  local ok, at = pcall(rate_allowed_at, prefix, r, now, 'rate')
  if not ok then return nil, now, 0 end
  local n = math.max(limit - used, 0)
  if (r[4] == 1 or r[4] == true) and n > 0 then n = 1 end
  if at > now then n = 0 end
  return n, at, used
end

-- RL-3: when the start after `n` more (woken now, not yet started) is allowed: the oldest
-- start in the window, `used` of them, a period on; unknown (nil) when the window is empty
-- or spread spaces the starts (the woken ones' own starts decide).
local function rate_after(prefix, r, used)
  if used <= 0 or r[4] == 1 or r[4] == true then return nil end
  local e = redis.call('ZRANGE', prefix .. 'rate:' .. r[1], -used, -used, 'WITHSCORES')
  if #e == 0 then return nil end
  return tonumber(e[2]) + tonumber(r[3])
end
