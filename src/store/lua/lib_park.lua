-- Parked waits, the second half of the shared helpers: scripts.rs appends this file after
-- lib_hold.lua (lib.lua names parked_wake, lock1_handoff and parked_wake_freed; they are
-- defined here).

-- Parked waits (PK-1..PK-7). A job whose lock or hold is taken, with the `park` policy, waits
-- in a list of its own, `<prefix>parked:lock:<id>` or `<prefix>parked:dep:<name>`, of JSON
-- entries {rid, queue, payload, parked_at, class, attempt, ttl, limit} (payload: the job's
-- exact bytes), oldest at the head. The ZSET `<prefix>parked` indexes the lists that have
-- entries (member "lock:<id>" or "dep:<name>", score: when the janitor should look at it next)
-- and the HASH `<prefix>parked_queues` counts the parked jobs per queue.

-- PK-2, PK-6: moves up to `max` entries from the head of the list of `res` ("lock:<id>" or
-- "dep:<name>") back to the heads of their queues, in parking order. It stops before the
-- first entry that cannot move (it does not decode, or its queue key holds another type):
-- that one stays parked, with its index entry, for the janitor to report. It never raises,
-- and it writes nothing before every check of what it moves was made. Returns the entries
-- moved (decoded), how many stay (counted up to one past `max`), and whether it stopped at
-- one that cannot move.
-- parked_wake of one entry (a release's handoff, PK-2): the same writes, checks and reply,
-- without the tables and loops a run of entries needs (the hot key's every release comes here).
local function wake_head(prefix, res)
  local pk = prefix .. 'parked:' .. res
  local raw = redis.pcall('LRANGE', pk, '0', '1')
  if type(raw) ~= 'table' or raw.err then return {}, 1, true end
  local e = raw[1]
  if e == nil then return {}, 0, false end
  local ok, d = pcall(cjson.decode, e)
  if not ok or type(d) ~= 'table' then return {}, #raw, true end
  local q, payload = d['queue'], d['payload']
  if type(q) ~= 'string' or type(payload) ~= 'string' then return {}, #raw, true end
  local ns = string.sub(prefix, 1, #prefix - 7)
  local qk = ns .. 'queue:' .. q
  local r = redis.pcall('LPUSH', qk, payload)
  if type(r) == 'table' and r.err then return {}, #raw, true end
  d['qk'] = qk
  redis.call('LPOP', pk)
  local class = d['class']
  count(prefix, nil, 'woken', type(class) == 'string' and class or '')
  redis.pcall('SADD', ns .. 'queues', q)
  redis.pcall('HINCRBY', prefix .. 'parked_queues', q, '-1')
  if #raw == 1 then redis.pcall('ZREM', prefix .. 'parked', res) end
  return {d}, #raw - 1, false
end

parked_wake = function(prefix, res, max)
  if max == 1 then return wake_head(prefix, res) end
  local pk = prefix .. 'parked:' .. res
  local raw = redis.pcall('LRANGE', pk, 0, max)
  if type(raw) ~= 'table' or raw.err then return {}, 1, true end
  local ns = string.sub(prefix, 1, #prefix - 7)
  local moved = {}
  local want = math.min(max, #raw)
  local bad = false
  local types = {}
  for i = 1, want do
    local ok, d = pcall(cjson.decode, raw[i])
    if not ok or type(d) ~= 'table' or type(d['queue']) ~= 'string' or
        type(d['payload']) ~= 'string' then
      bad = true
      break
    end
    local qk = ns .. 'queue:' .. d['queue']
    -- One entry is pushed with pcall (a refused push writes nothing); a run of them is
    -- checked first, so that none is pushed when a later one would be refused.
    if want > 1 then
      if types[qk] == nil then
        local t = redis.call('TYPE', qk)['ok']
        types[qk] = (t == 'none' or t == 'list')
      end
      if not types[qk] then
        bad = true
        break
      end
    end
    d['qk'] = qk
    moved[#moved + 1] = d
  end
  local n = #moved
  if n == 1 and want == 1 then
    local r = redis.pcall('LPUSH', moved[1]['qk'], moved[1]['payload'])
    if type(r) == 'table' and r.err then
      n = 0
      moved = {}
      bad = true
    end
  else
    for i = n, 1, -1 do redis.call('LPUSH', moved[i]['qk'], moved[i]['payload']) end
  end
  local left = #raw - n
  if n == 0 then return moved, left, bad end
  if n == 1 then redis.call('LPOP', pk) else redis.call('LTRIM', pk, n, -1) end
  local per_queue = {}
  for i = 1, n do
    local d = moved[i]
    per_queue[d['queue']] = (per_queue[d['queue']] or 0) + 1
    count(prefix, nil, 'woken', type(d['class']) == 'string' and d['class'] or '')
  end
  for q, c in pairs(per_queue) do
    redis.pcall('SADD', ns .. 'queues', q)
    redis.pcall('HINCRBY', prefix .. 'parked_queues', q, int(-c))
  end
  if left == 0 then redis.pcall('ZREM', prefix .. 'parked', res) end
  return moved, left, bad
end

-- PK-3: the key a parked entry's unit is kept for, the SHA1 of its payload's bytes (Redis's
-- own SHA1: no hashing in Lua, and no digest needed from the worker, which TAKE does not
-- send). The woken job is pushed with those very bytes, so its ACQUIRE finds the same key
-- (acq.unit_key).
local function unit_key(d)
  return redis.sha1hex(d['payload'])
end

-- PK-2, PK-3 for a limit-1 lock whose unit is free (its holder left, or its lease lapsed):
-- wakes the first job parked on it and hands the unit to it: the lock's value becomes a
-- handoff, `~` and the SHA1 of that job's payload in place of a token, for the job's
-- lock_ttl. Only an ACQUIRE of that payload (that job, or one with the same bytes) takes it
-- over (acquire.lua), whatever its limit (L-1b: a job of a larger limit makes the lock its
-- ZSET); every other job meets the lock
-- full and parks behind the others, so the jobs of one key run in parking order. The handoff
-- keeps the parked flag while jobs stay parked, and passes it on to the job that takes it.
-- Returns what parked_wake returns (the key is written only when a job was woken).
local function lock1_hand(prefix, lk, id)
  local moved, left, bad = parked_wake(prefix, 'lock:' .. id, 1)
  if #moved == 0 then return moved, left, bad end
  local d = moved[1]
  local v = '{"blocked":' .. (left > 0 and '2' or '0') .. ',"token":"~' .. unit_key(d) ..
    '","handoff":true,"queue":' .. cjson.encode(d['queue']) .. '}'
  redis.call('SET', lk, v, 'PX', int(tonumber(d['ttl']) or 35000))
  known[lk] = v
  return moved, left, bad
end
-- lock1_hand, answering whether a job was woken.
lock1_handoff = function(prefix, lk, id)
  local moved = lock1_hand(prefix, lk, id)
  return #moved > 0
end

-- One unit of the ZSET `lk` kept for the parked entry `d` (lockn_handoff): the member
-- `~<SHA1 of its payload>`, scored with the entry's lock_ttl deadline, and its lockinfo field.
-- `parked`: its job stays parked at the head of the list (a place-holder, L-1b). Never raises
-- (PK-6).
local function keep_unit(lk, ik, d, now, parked)
  local who = unit_key(d)
  local r = redis.pcall('ZADD', lk, int(now + (tonumber(d['ttl']) or 35000)), '~' .. who)
  if type(r) ~= 'number' then return false end
  local digest = type(d['digest']) == 'string' and
    (',"digest":' .. cjson.encode(d['digest'])) or ''
  redis.pcall('HSET', ik, '~' .. who, '{"handoff":true,"queue":' .. cjson.encode(d['queue']) ..
    digest .. ',"limit":' .. int(tonumber(d['limit']) or 0) ..
    (parked and ',"parked":true' or '') .. ',"acquired_at":' .. int(now) .. '}')
  return true
end

-- PK-2, PK-3, PK-5 for a lock of a larger limit (a ZSET) with `n` free units: wakes jobs
-- parked on it and keeps a unit for each, as lock1_handoff does for a limit-1 lock: the
-- member `~<SHA1 of the woken payload>` scored with the woken job's lock_ttl deadline counts
-- as a holder (its lockinfo field says it is a handoff). Only an ACQUIRE of that payload takes
-- it over (acquire.lua); every other job meets the lock full and parks behind the others. A
-- handoff that its job does not take lapses as a holder's lease does, and the purge that
-- drops it wakes the next job. Two woken jobs of one payload share one member (the second
-- then takes a free unit, or parks again).
-- L-1b, mixed limits: units go in parking order, and a job gets one only when its own limit
-- admits it beside the lock's members and beside the jobs given one before it in this step
-- (so each woken job can start). The first job that cannot is not passed over: it keeps the
-- unit as a place-holder (a `~` member while it stays parked at the head; one it has already
-- gets its deadline again), so that later jobs meet the lock full and it drains to it. A job
-- of limit 1 gets the lock only once nothing else holds it: the ZSET is deleted and the lock
-- becomes its limit-1 handoff (lock1_hand), which every other job meets full. With `n` = 0
-- only jobs whose units are kept already wake (the janitor's look).
-- Never raises (PK-6); returns what parked_wake returns.
lockn_handoff = function(p, id, n)
  local res = 'lock:' .. id
  local lk, ik = p .. 'lock:' .. id, p .. 'lockinfo:' .. id
  local raw = redis.pcall('LRANGE', p .. 'parked:' .. res, 0, n + 9)
  if type(raw) ~= 'table' or raw.err then return {}, 1, true end
  local members = redis.pcall('ZCARD', lk)
  if type(members) ~= 'number' then
    -- A key of another type (a limit-1 holder's STRING) keeps no unit: its release wakes.
    lock1_mark_parked(lk)
    return {}, #raw, false
  end
  local now = now_ms()
  local wake, bound, given = 0, nil, {}
  local alone, hold, refresh, broken = false, nil, nil, false
  for i = 1, #raw do
    local ok, d = pcall(cjson.decode, raw[i])
    if not ok or type(d) ~= 'table' or type(d['payload']) ~= 'string' then
      -- parked_wake stops before it too, and reports it
      broken = true
      break
    end
    local who = unit_key(d)
    local limit = math.max(tonumber(d['limit']) or 1, 1)
    local own = not given[who] and redis.call('ZSCORE', lk, '~' .. who) ~= false
    local others = members - (own and 1 or 0)
    local cap = math.min(limit, bound or limit)
    if others + 1 > cap or (n == 0 and not own) then
      if own then refresh = d elseif wake == 0 and n > 0 then hold = d end
      break
    end
    if limit == 1 then
      -- others is 0 here, and this is the first entry: the lock is its own.
      alone = true
      break
    end
    wake = wake + 1
    bound = cap
    given[who] = true
    if not own then
      members = members + 1
      n = n - 1
    end
  end
  if alone then
    redis.call('DEL', lk, ik)
    redis.call('ZREM', p .. 'locks', id)
    known[lk] = false
    return lock1_hand(p, lk, id)
  end
  local moved, left, bad = {}, #raw, broken
  if wake > 0 then moved, left, bad = parked_wake(p, res, wake) end
  local kept = false
  for _, d in ipairs(moved) do
    if keep_unit(lk, ik, d, now, false) then kept = true end
  end
  local keep = hold or refresh
  if keep and keep_unit(lk, ik, keep, now, true) then kept = true end
  if kept then fix_lock(lk, ik, p .. 'locks', id) end
  return moved, left, bad
end

-- L-1b: a woken job that the lock refuses although a unit of it was kept for it (its limit
-- is lower than the one it parked with) has just parked again at the head of the list
-- (acquire.lua). Its unit goes, and so does the place-holder of the job that was first
-- (lockn_handoff keeps one for the head only), and nobody is woken: the lock's next release
-- or lapse hands the unit to the head. Units kept for jobs that cannot start would otherwise
-- wait on each other until they lapse. `member`: the woken job's (acq.kept_member). Never
-- raises.
local function unkeep_for_head(p, id, member)
  local lk, ik = p .. 'lock:' .. id, p .. 'lockinfo:' .. id
  local drop = {member}
  local was_first = redis.pcall('LINDEX', p .. 'parked:lock:' .. id, 1)
  if type(was_first) == 'string' then
    local ok, d = pcall(cjson.decode, was_first)
    if ok and type(d) == 'table' and type(d['payload']) == 'string' then
      drop[2] = '~' .. unit_key(d)
    end
  end
  if type(redis.pcall('ZREM', lk, unpack(drop))) == 'number' then
    redis.pcall('HDEL', ik, unpack(drop))
    fix_lock(lk, ik, p .. 'locks', id)
  end
end

-- PK-2, PK-5 for a lock of a larger limit (a ZSET) that lost `freed` holders: as many parked
-- jobs wake (to the heads of their queues), each with the unit kept for it (lockn_handoff).
parked_wake_freed = function(lock_key, counter_prefix, freed)
  if freed <= 0 then return end
  local p = string.sub(counter_prefix, 1, #counter_prefix - 8)
  local id = string.sub(lock_key, #p + 6)
  if redis.call('EXISTS', p .. 'parked:lock:' .. id) == 0 then return end
  lockn_handoff(p, id, freed)
end
