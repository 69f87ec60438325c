-- Parked waits, the second half of the shared helpers: scripts.rs appends this file to lib.lua
-- (lib.lua names parked_wake, lock1_handoff and parked_wake_freed; they are defined here).

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
parked_wake = function(prefix, res, max)
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

-- PK-2, PK-3 for a limit-1 lock whose unit is free (its holder left, or its lease lapsed):
-- wakes the first job parked on it and hands the unit to it: the lock's value becomes a
-- handoff, `~` and that job's payload digest in place of a token, for the job's lock_ttl.
-- Only an ACQUIRE of that digest (that job, or one with the same class and args) takes it
-- over (acquire.lua); every other job meets the lock
-- full and parks behind the others, so the jobs of one key run in parking order. The handoff
-- keeps the parked flag while jobs stay parked, and passes it on to the job that takes it.
-- Returns true when a job was woken (the key was written), false when none could be (the key
-- is left as it was).
lock1_handoff = function(prefix, lk, id)
  local moved, left = parked_wake(prefix, 'lock:' .. id, 1)
  if #moved == 0 then return false end
  local d = moved[1]
  local who = type(d['digest']) == 'string' and d['digest'] or redis.sha1hex(d['payload'])
  local v = '{"blocked":' .. (left > 0 and '2' or '0') .. ',"token":"~' .. who ..
    '","handoff":true,"queue":' .. cjson.encode(d['queue']) .. '}'
  redis.call('SET', lk, v, 'PX', int(tonumber(d['ttl']) or 35000))
  known[lk] = v
  return true
end

-- PK-2, PK-3, PK-5 for a lock of a larger limit (a ZSET) with `n` free units: wakes up to `n`
-- jobs parked on it and keeps a unit for each, as lock1_handoff does for a limit-1 lock: the
-- member `~<digest of the woken payload>` scored with the woken job's lock_ttl deadline counts
-- as a holder (its lockinfo field says it is a handoff). Only an ACQUIRE of that digest takes
-- it over (acquire.lua); every other job meets the lock full and parks behind the others. A
-- handoff that its job does not take lapses as a holder's lease does, and the purge that
-- drops it wakes the next job. Two woken jobs of one digest share one member (the second
-- then takes a free unit, or parks again). Never raises (PK-6); returns what parked_wake
-- returns.
lockn_handoff = function(p, id, n)
  local moved, left, bad = parked_wake(p, 'lock:' .. id, n)
  if #moved == 0 then return moved, left, bad end
  local lk, ik = p .. 'lock:' .. id, p .. 'lockinfo:' .. id
  local now = now_ms()
  local kept = false
  for _, d in ipairs(moved) do
    local who = type(d['digest']) == 'string' and d['digest'] or redis.sha1hex(d['payload'])
    local r = redis.pcall('ZADD', lk, int(now + (tonumber(d['ttl']) or 35000)), '~' .. who)
    if type(r) == 'number' then
      kept = true
      redis.pcall('HSET', ik, '~' .. who, '{"handoff":true,"queue":' ..
        cjson.encode(d['queue']) .. ',"digest":"' .. who .. '","limit":' ..
        int(tonumber(d['limit']) or 0) .. ',"acquired_at":' .. int(now) .. '}')
    end
  end
  -- A key of another type (a limit-1 holder's) keeps no unit: the woken jobs compete.
  if kept then fix_lock(lk, ik, p .. 'locks', id) end
  return moved, left, bad
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
