-- Keyed rate limits (rate-limits.md RL-1..RL-4), prepended after lib.lua to every locket script
-- by src/store/scripts.rs. Nothing here touches a key on its own.
--
-- <prefix>ratelog:<key>      STRING, the key's sliding log (src/store/rates.rs reads it too):
--                            a 7-byte header, byte 0xB1 (format 1) then the ms until which a
--                            handler's back-off closed the key (RL-4; 0: not closed), then
--                            the starts (Redis TIME, ms), oldest first, 6 bytes each, big
--                            endian. At most `limit` starts, none a period old (they can no
--                            longer be in a window); PX to a period after the last start, or
--                            to the close if later (RL-1). ACQUIRE reads it in its MGET
--                            (lib_reads.lua acquire_reads) and writes it with one SET.
-- <prefix>rate:<key>         ZSET, the starts of a key whose limit is above RATE_STRING_MAX:
--                            member = the start's reservation id, score = its start (ms), at
--                            most `limit` of them, PEXPIRE a period after the last start. A
--                            string of thousands of starts costs more Redis CPU to copy in
--                            and out at each start than the ZSET's three or four commands
--                            (docs/spec/rate-limits.md §5 has the figures). Its close stays
--                            in the header of its `ratelog:` string (no starts there).
-- <prefix>parked:rate:<key>  the parked list of the jobs it refused (RL-3, lib.lua's
--                            parked_wake), indexed in <prefix>parked as "rate:<key>" with the
--                            time its next start is allowed.
--
-- A rate `r` is {key, limit, period ms, spread (0 or 1)}, as ACQUIRE's options carry it.
-- A log is {s = its string or nil (absent, or a key of another type: MGET says nil for
-- both), n = its starts, closed = ms (0: open)}.

local RATE_MAGIC = '\177'
local RATE_HEAD = 7
-- The largest limit whose starts are kept in the string (RL-6); larger ones use the ZSET.
local RATE_STRING_MAX = 256

local function rate_in_zset(r)
  return tonumber(r[2]) > RATE_STRING_MAX
end

-- The 6-byte big-endian number at byte `pos` of `s`.
local function rate_u48(s, pos)
  local a, b, c, d, e, f = string.byte(s, pos, pos + 5)
  return ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f
end

-- `x` (0 <= x < 2^48) as 6 bytes, big endian.
local function rate_p48(x)
  x = math.floor(x)
  local b = {}
  for i = 6, 1, -1 do
    b[i] = x % 256
    x = math.floor(x / 256)
  end
  return string.char(b[1], b[2], b[3], b[4], b[5], b[6])
end

local function rate_log_key(prefix, key)
  return prefix .. 'ratelog:' .. key
end

-- The log of `key` as this step sees it; nil when the key holds a string that is no log.
local function rate_log(prefix, key)
  local v = sget(rate_log_key(prefix, key))
  if not v then return {s = nil, n = 0, closed = 0} end
  if #v < RATE_HEAD or string.sub(v, 1, 1) ~= RATE_MAGIC or (#v - RATE_HEAD) % 6 ~= 0 then
    return nil
  end
  return {s = v, n = (#v - RATE_HEAD) / 6, closed = rate_u48(v, 2)}
end

-- The i-th start (1 = oldest) of log `l`.
local function rate_at(l, i)
  return rate_u48(l.s, RATE_HEAD + 1 + (i - 1) * 6)
end

-- The first start of `l` after `t` (n + 1 when none is): the log is in order.
local function rate_first_after(l, t)
  local lo, hi = 1, l.n + 1
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if rate_at(l, mid) > t then hi = mid else lo = mid + 1 end
  end
  return lo
end

-- The log `rk` as a LOCKET_STORE error: another type, or a string that is no log (`what`);
-- raised before any write of the step, or after undoing them (S-6).
local function rate_wrongtype(step, rk, what)
  error({err = 'LOCKET_STORE ' .. step .. ': WRONGTYPE ' .. rk .. ' ' .. what ..
    ', not a rate log; nothing was changed'})
end

-- RL-1: when the next start of rate `r` is allowed (ms, Redis clock; <= now: allowed now),
-- and its log. The log's `limit`-th newest start bounds any sliding window: a start is
-- allowed once it is a period old. With spread, the newest must also be period/limit old.
-- Reads only (the log came with the step's MGET); raises a LOCKET_STORE error for a string
-- that is no log.
local function rate_allowed_at(prefix, r, now, step)
  local limit, period = tonumber(r[2]), tonumber(r[3])
  local l = rate_log(prefix, r[1])
  if l == nil then rate_wrongtype(step, rate_log_key(prefix, r[1]), 'holds a string') end
  local at = now
  if l.closed > at then at = l.closed end
  local spread = r[4] == 1 or r[4] == true
  if rate_in_zset(r) then
    local zk = prefix .. 'rate:' .. r[1]
    local nth = redis.pcall('ZRANGE', zk, -limit, -limit, 'WITHSCORES')
    if type(nth) ~= 'table' or nth.err then
      local t = redis.pcall('TYPE', zk)
      rate_wrongtype(step, zk, 'holds a ' .. (type(t) == 'table' and t['ok'] or '?'))
    end
    l.full = #nth > 0
    if l.full and tonumber(nth[2]) + period > at then at = tonumber(nth[2]) + period end
    if spread then
      local last = redis.call('ZRANGE', zk, -1, -1, 'WITHSCORES')
      if #last > 0 then
        local t = tonumber(last[2]) + math.ceil(period / limit)
        if t > at then at = t end
      end
    end
    return at, l
  end
  l.full = l.n >= limit
  if l.full then
    local t = rate_at(l, l.n - limit + 1) + period
    if t > at then at = t end
  end
  if spread and l.n > 0 then
    local t = rate_at(l, l.n) + math.ceil(period / limit)
    if t > at then at = t end
  end
  return at, l
end

-- The log `l` of rate `r` with a start at `now` added (the oldest dropped past `limit`, and
-- those a period old), as {value, ms to live}; `closed` replaces the close when given (RL-4).
local function rate_next(r, l, now, start, closed)
  local limit, period = tonumber(r[2]) or 1, tonumber(r[3]) or 0
  closed = closed or l.closed
  if closed <= now then closed = 0 end
  local tail, last = '', 0
  if l.n > 0 then
    last = rate_at(l, l.n)
    local first = rate_first_after(l, now - period)
    if start then
      if l.n - limit + 2 > first then first = l.n - limit + 2 end
    end
    if first <= l.n then tail = string.sub(l.s, RATE_HEAD + 1 + (first - 1) * 6) end
  end
  if start then
    -- Redis's clock stepped back: the start is logged at the newest one, keeping the order.
    if last > now then now = last end
    last = now
    tail = tail .. rate_p48(now)
  end
  local untl = last + period
  if closed > untl then untl = closed end
  return RATE_MAGIC .. rate_p48(closed) .. tail, untl
end

-- Writes `value` (to live until `untl`) over the log `l` of `key` that this step read: a SET
-- over a log (a string, as read), a SET NX where nothing was read (absent, or another type:
-- then nothing is written and false is returned).
local function rate_write(prefix, key, l, value, untl, now)
  local rk = rate_log_key(prefix, key)
  local px = int(math.max(untl - now, 1))
  local ok
  if l.s then
    ok = redis.call('SET', rk, value, 'PX', px)
  else
    ok = redis.call('SET', rk, value, 'NX', 'PX', px)
  end
  if not ok then return false end
  known[rk] = value
  return true
end

-- Puts back the log `l` of `key` as it was read (a step that wrote it is undone).
local function rate_restore(prefix, key, l, r, now)
  local rk = rate_log_key(prefix, key)
  if not l.s then
    redis.call('DEL', rk)
    known[rk] = false
    return
  end
  local untl = l.closed
  if l.n > 0 then untl = math.max(untl, rate_at(l, l.n) + tonumber(r[3])) end
  if untl > now then
    redis.call('SET', rk, l.s, 'PX', int(untl - now))
    known[rk] = l.s
  else
    redis.call('DEL', rk)
    known[rk] = false
  end
end

-- RL-1: records a start `member` of each of `rates` at `now` (their allowed_at said yes, in
-- this step, and read `logs`): one SET each for the string logs, first; a string log that
-- turns out to be of another type undoes the ones written and raises (S-6; the caller
-- undoes its own writes first, `undo`). Then the ZSETs (their type was checked as they were
-- read): ZADD, PEXPIRE, and a trim when full.
local function rate_record(prefix, rates, logs, now, step, undo, member)
  local written = {}
  for i, r in ipairs(rates) do
    if not rate_in_zset(r) then
      local v, untl = rate_next(r, logs[i], now, true)
      if not rate_write(prefix, r[1], logs[i], v, untl, now) then
        for _, j in ipairs(written) do rate_restore(prefix, rates[j][1], logs[j], rates[j], now) end
        if undo then undo() end
        local rk = rate_log_key(prefix, r[1])
        local t = redis.pcall('TYPE', rk)
        t = type(t) == 'table' and t['ok'] or '?'
        rate_wrongtype(step, rk, 'holds a ' .. t)
      end
      written[#written + 1] = i
    end
  end
  for i, r in ipairs(rates) do
    if rate_in_zset(r) then
      local zk = prefix .. 'rate:' .. r[1]
      redis.call('ZADD', zk, int(now), member)
      if logs[i].full then redis.call('ZREMRANGEBYRANK', zk, 0, -(tonumber(r[2]) + 1)) end
      redis.call('PEXPIRE', zk, int(r[3]))
    end
  end
end

-- RL-4: closes rate `r` until `untl` (a later close stays). Returns the close in force, or
-- nil when the log cannot be written (another type: nothing written).
local function rate_close(prefix, r, untl, now)
  local l = rate_log(prefix, r[1])
  if l == nil then return nil end
  if l.closed >= untl then return l.closed end
  local v, live = rate_next(r, l, now, false, untl)
  if not rate_write(prefix, r[1], l, v, live, now) then return nil end
  return untl
end

-- RL-3, RL-5: how many starts `r` allows now, when the next one is allowed (ms), the starts
-- in the window now, and its log; nil when its log holds another type.
local function rate_free(prefix, r, now)
  local limit, period = tonumber(r[2]), tonumber(r[3])
  local l = rate_log(prefix, r[1])
  if l == nil then return nil, now, 0 end
  if not l.s and redis.call('EXISTS', rate_log_key(prefix, r[1])) == 1 then
    return nil, now, 0
  end
  if l.closed > now then return 0, l.closed, 0, l end
  local used
  if rate_in_zset(r) then
    used = redis.pcall('ZCOUNT', prefix .. 'rate:' .. r[1], '(' .. int(now - period), '+inf')
    if type(used) ~= 'number' then return nil, now, 0 end
  else
    used = l.n - rate_first_after(l, now - period) + 1
  end
  local at = rate_allowed_at(prefix, r, now, 'rate')
  local n = math.max(limit - used, 0)
  if (r[4] == 1 or r[4] == true) and n > 0 then n = 1 end
  if at > now then n = 0 end
  return n, at, used, l
end

-- RL-3: when the start after `n` more (woken now, not yet started) is allowed: the oldest
-- start in the window, `used` of them, a period on; unknown (nil) when the window is empty
-- or spread spaces the starts (the woken ones' own starts decide).
local function rate_after(prefix, l, r, used)
  if not l or used <= 0 or r[4] == 1 or r[4] == true then return nil end
  if rate_in_zset(r) then
    local e = redis.call('ZRANGE', prefix .. 'rate:' .. r[1], -used, -used, 'WITHSCORES')
    if #e == 0 then return nil end
    return tonumber(e[2]) + tonumber(r[3])
  end
  if used > l.n then return nil end
  return rate_at(l, l.n - used + 1) + tonumber(r[3])
end
