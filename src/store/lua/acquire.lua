-- ACQUIRE with START (locking-semantics.md A-6, A-7, A-8, L-2, L-4, L-10, P-1..P-5, D-4, D-5,
-- D-9, O-3).
-- Takes every lock of the job or none and checks its `locked_by` holds; on success starts the
-- job (adding its start-time holds and ensuring its enqueue-time holds), on conflict settles it
-- by the fallback in the same step: requeue to the tail with the counter bump, delay, discard,
-- fail, or leave it reserved ("none", the wait policy). With no locks and no holds it is
-- START alone.
--
-- KEYS[1]      <ns>:locket:inflight:<slot key>
-- KEYS[2]      <ns>:queue:<q>
-- KEYS[3]      <ns>:queues
-- KEYS[4]      <ns>:locket:counter:<q>
-- KEYS[5]      <ns>:worker:<resque worker id>        (Resque "working on" record)
-- KEYS[6]      <ns>:locket:locks                     (index, L-7)
-- KEYS[6+i]    <ns>:locket:lock:<id_i>               for i = 1..n (a STRING for limit 1, else
--              a ZSET with its lockinfo; lib.lua). Its lockinfo:<id_i> and blocked:lock:<id_i>
--              are named here from the id, and only read when used (S-1: no Cluster).
-- ARGV[1]      rid
-- ARGV[2]      token (32 hex chars, new for this attempt)
-- ARGV[3]      lock_ttl in ms
-- ARGV[4]      counter_ttl in ms
-- ARGV[5]      fallback for a lock conflict: "park", "requeue", "delay", "discard", "fail" or
--              "none"
-- ARGV[6]      Resque working-on JSON for KEYS[5]
-- ARGV[7]      lockinfo JSON object (holder metadata; limit, times and source are added here)
-- ARGV[8]      counter key prefix, "<ns>:locket:counter:" (the locket prefix is derived from it)
-- ARGV[9]      queue name q
-- ARGV[10]     class
-- ARGV[11]     digest
-- ARGV[12]     options JSON, or "" for none (the plain path decodes nothing):
--                locked_by      [hold name...]          checked (D-5)
--                enqueue_holds  [hold name...]          ensured on start (D-4), self-exclusion
--                start_holds    [hold name...]          added on start (D-9)
--                hold_ttl       ms
--                dep_fallback   fallback for a locked_by conflict (it wins over ARGV[5])
--                fencing        true: HINCRBY fence <id> per lock (L-10)
--                sources        [full rendered text per lock] (T-5 lock_id_source)
--                delay          {base, max (ms), r (jitter draw), max_delays}
--                failure        Resque failure record with "__LOCKET_CONFLICT__" as its error
--                failed_list, stat_failed, stat_failed_by, failed_queues, multi_name
--                wait           true when a policy is wait: a kept job is marked "waiting"
--                last_wait      true on the last try of a wait (counts wait_timeout)
--                attempts       true: HDEL attempts <digest> on start (A-8)
--                max_parked     most entries of one parked list (PK-7), default 100000
--                park_full      the fallback when it is full, default "requeue"
--                rates          [[key, limit, period ms, spread 0/1]...] (rate-limits.md RL-1,
--                               RL-2): all must allow the start; a refusal parks the job on
--                               the first refusing rate (RL-3), whatever the lock policy
--                unique         [key, policy, ttl ms] of a unique entry that follows the job
--                               (U-2..U-4, lib_unique.lua): START records it in the record
--                               (field `unique`) and, for until_executing, releases the entry;
--                               discard and fail release it; park and delay carry it in
--                               the job's entry; requeue and wait keep it
-- ARGV[13]     the worker's clock in ms (acquired_at, started_at: shown, never a deadline)
-- ARGV[14]     "1" when this ACQUIRE is sent again after an attempt whose reply never came
-- ARGV[13+2i]  lock id i       for i = 1..n
-- ARGV[14+2i]  limit i
-- Holds, the delayed set and the reservation's cancel request (`cancel_start:<rid>`, read in
-- the step's MGET) are named from the locket prefix (S-1: no Cluster).
--
-- Returns one of
--   {"ok", deadline_ms, fence_1, ..., fence_n}   (fences only with fencing; also when this
--        rid and token already started: a retried call). deadline_ms is the Redis server's
--        when a lock of a larger limit was taken, else the worker's clock + lock_ttl (a
--        limit-1 lock's lease is its key's PX, and no server time is read).
--   {"conflict", action, due_ms, attempt, kind_1, id_1, holders_1, limit_1, earliest_1, ...}
--        action: "parked", "requeued", "delayed", "discarded", "failed" or "none" (still
--        reserved);
--        due_ms and attempt are set for "delayed" (attempt also for "failed" by max_delays);
--        one group of five per conflicting resource, kind "lock", "dep" (limit 0) or
--        "rate" (holders: the limit when its window is full, else 0; earliest: the time its
--        next start is allowed)
--   {"cancelled", request}   an operator cancelled this reservation before it started (A-21):
--        its `cancel_start:<rid>` request (JSON) was taken and deleted; nothing else changed
--   {"missing"}   the reservation is no longer this slot's (R-6); nothing changed
--   {"dead"}      the slot's process lease is gone (R-2); nothing changed
-- Raises a LOCKET_STORE error, having changed nothing, when a conflict's fallback would push
-- to a queue, `queues`, a failure list or `failed_queues` that holds another type (S-6).

local inflight = KEYS[1]
-- A-22: a job that leaves its reservation in a conflict path frees its queue's unit
-- (redis.pcall: a set spoiled by hand is left to the janitor, never a half-done step).
local function free_unit()
  local p = locket_prefix(ARGV[8])
  if sget(p .. 'cap:' .. ARGV[9]) then
    redis.pcall('SREM', p .. 'running:' .. ARGV[9], ARGV[1] .. ' ' .. inflight)
  end
end
local n = (#ARGV - 14) / 2
local ttl = tonumber(ARGV[3])
local counter_prefix = ARGV[8]
local prefix = locket_prefix(counter_prefix)
local wnow = tonumber(ARGV[13]) or 0
-- One read for the lease (R-2) and the queue's counter (A-8), unless a FINISH+RESERVE or a
-- batch read them already.
if not reads_done then prefetch(acquire_reads(KEYS, ARGV)) end
local alive = lease_held(prefix, inflight)
-- While the lease is held only this process writes its slot record, so a first call needs no
-- rid check (lib.lua, lease_trusted). A call sent again, or one whose lease is gone, reads it.
if ARGV[14] == '1' or not lease_trusted(prefix, inflight) then
  local rec = redis.call('HMGET', inflight, 'rid', 'token', 'state')
  if rec[1] ~= ARGV[1] then
    return {'missing'}
  end
  -- A retry after a lost reply: this attempt already started; answer as the first call did.
  if rec[2] == ARGV[2] and rec[3] == 'running' then
    local out = {'ok', wnow + ttl}
    local fences = redis.call('HGET', inflight, 'fences')
    if fences then
      for _, f in ipairs(cjson.decode(fences)) do out[#out + 1] = f end
    end
    return out
  end
  -- R-2: a process whose lease is gone starts nothing; the reservation stays in its record,
  -- where recovery finds it (R-4).
  if not alive then
    return {'dead'}
  end
end
-- A-21: an operator cancelled this reservation before it started: it does not start. The
-- request is taken (its key deleted, this step's only write) and handed to the worker, which
-- records the job as cancelled (or puts it back with `--requeue`) by FINISH; nothing of the
-- job ran, no lock was taken.
local cancelled = take_cancel_start(prefix, ARGV[1])
if cancelled then
  return {'cancelled', cancelled}
end

local queue = ARGV[9]
local class = ARGV[10]
local digest = ARGV[11]

-- The lockinfo object gets its times and per-lock fields appended as text (the object from
-- the worker holds none of them), which spares a cjson decode and encode per lock. Its fields
-- without the braces, and the comma that goes before them, are cut once per call; each value
-- is then made by one concatenation (every string Lua makes is hashed byte by byte here, and
-- the limit-1 lock's value is the job path's longest).
local info_inner = string.sub(ARGV[7], 2, -2)
local info_sep = (info_inner ~= '') and ',' or ''
-- A limit-1 lock's value, this attempt's: {"blocked":0,"token":"<token>",<holder fields>,
-- "acquired_at":..,"limit":1,"lock_id":..,"lock_id_source":..[,"fence":..]} (lib.lua).
local function lock1_value(id_json, source, fence_field)
  return LOCK1_HEAD .. ARGV[2] .. '"' .. info_sep .. info_inner .. ',"acquired_at":' ..
    int(wnow) .. ',"limit":1,"lock_id":' .. id_json .. ',"lock_id_source":' .. source ..
    fence_field .. '}'
end
-- START (A-8): the job runs; work could be done in q, so its counter restarts. `ids` are the
-- locks' ids as JSON strings; `holds` and `fence_list` lists, or nil for none; `now` the
-- server time when this step read it, else nil (count reads it only if it needs it).
local function start_job(ids, holds, fence_list, now)
  redis.call('HSET', inflight,
    'state', 'running',
    'started_at', int(wnow),
    'token', ARGV[2],
    'locks', '[' .. table.concat(ids, ',') .. ']',
    'class', class,
    'digest', digest)
  if holds and #holds > 0 then redis.call('HSET', inflight, 'holds', cjson.encode(holds)) end
  if fence_list and #fence_list > 0 then
    redis.call('HSET', inflight, 'fences', cjson.encode(fence_list))
  end
  redis.call('SET', KEYS[5], ARGV[6])
  clear_counter(KEYS[4])
  if n > 0 then count(prefix, now, 'acquired', class) end
  count(prefix, now, 'started', class)
end

-- The plain case, in few steps: no options (no holds, rates, fencing, sources or wait), every
-- lock of limit 1 and, by the step's MGET, free. Each lock is taken by SET NX PX with the
-- value the full path below writes, then the job starts as it starts there. A SET NX that
-- finds a key anyway (one of another type: MGET reads it as absent) gives back the locks
-- just taken and hands the step to the full path, which settles the conflict.
if ARGV[12] == '' then
  local plain = true
  for i = 1, n do
    if tonumber(ARGV[14 + 2 * i]) > 1 or known[KEYS[6 + i]] ~= false then
      plain = false
      break
    end
  end
  if plain then
    local ids = {}
    local got = 0
    for i = 1, n do
      local lk = KEYS[6 + i]
      local id_json = cjson.encode(ARGV[13 + 2 * i])
      ids[i] = id_json
      local v = lock1_value(id_json, id_json, '')
      if not redis.call('SET', lk, v, 'NX', 'PX', int(ttl)) then break end
      known[lk] = v
      got = i
    end
    if got == n then
      start_job(ids, nil, nil, nil)
      return {'ok', wnow + ttl}
    end
    -- Not all taken: the ones taken go back, as if never taken (L-4).
    for i = 1, got do
      redis.call('DEL', KEYS[6 + i])
      known[KEYS[6 + i]] = false
    end
  end
end

local opt = {}
if ARGV[12] ~= '' then opt = cjson.decode(ARGV[12]) end
local locked_by = opt['locked_by'] or {}
local enqueue_holds = opt['enqueue_holds'] or {}
local start_holds = opt['start_holds'] or {}
local function lock_at(i)
  return KEYS[6 + i], ARGV[13 + 2 * i], tonumber(ARGV[14 + 2 * i])
end

-- RL-1, RL-2: the rates are read first, before any write of this step (a log of another type
-- raises here, having changed nothing); a refusal is a conflict like a lock's, so no lock is
-- taken, and a lock's refusal records no start.
-- The logs came with the step's MGET (rate.lua): reading them costs no command.
local rates = opt['rates'] or {}
local rate_logs = {}
local rate_conflicts = {}
for i, r in ipairs(rates) do
  local at, l = rate_allowed_at(prefix, r, now_ms(), 'acquire')
  rate_logs[i] = l
  if at > now_ms() then
    local full = l.full
    rate_conflicts[#rate_conflicts + 1] = {'rate', r[1], full and int(r[2]) or 0, int(r[2]),
      int(at), nil, r}
  end
end

-- A conflict on a lock whose key is a limit-1 holder's STRING (or, for a limit-1 lock, a
-- larger lock's ZSET, which counts as full too): its holders, the limit asked for, and its
-- deadline from the key's PTTL. With the park policy the deadline is read only when the
-- parked index needs it (the reply then says 0).
local function lock1_conflict(lk, id, limit)
  local holders = 1
  if not sget(lk) then
    holders = tonumber(redis.pcall('ZCARD', lk)) or 1
  end
  if ARGV[5] == 'park' then return {'lock', id, holders, limit, '0', lk} end
  local left = redis.call('PTTL', lk)
  return {'lock', id, holders, limit, int(now_ms() + math.max(left, 0))}
end

-- PK-3, L-1b: whether a limit-1 lock's value is a handoff to this job's payload
-- (lib_park.lua lock1_hand: "~<digest>" in place of the token).
local function handed_to_me(hv)
  return hv and string.sub(hv, 23, 23) == '~' and
    string.sub(hv, 24, 24 + #digest) == digest .. '"'
end

-- Purge and count every lock of a larger limit first: all or nothing (L-4). Report every
-- conflicting one.
local conflicts = {}
local dep_conflict = false
local was_empty = {}
-- PK-3: per lock i, a unit kept for this payload in the lock's ZSET (lockn_handoff) ...
local kept_for_me = {}
-- ... or the lock handed to it as a limit-1 lock (its STRING value): either is this job's to
-- take over whatever its own limit (L-1b), and neither counts against it.
local handed = {}
for i = 1, n do
  local lk, id, limit = lock_at(i)
  if limit > 1 then
    local ik, bk = prefix .. 'lockinfo:' .. id, prefix .. 'blocked:lock:' .. id
    local now = now_ms()
    local hv = sget(lk)
    local empty = true
    if not hv then
      local purged
      purged, empty = purge_expired(lk, ik, bk, now, counter_prefix)
      if purged > 0 then
        fix_lock(lk, ik, KEYS[6], id)
        count(prefix, now, 'expired', '', purged)
      end
      -- The purge's wake may have handed the lock to a parked limit-1 job (L-1b).
      hv = sget(lk)
    end
    if handed_to_me(hv) then
      -- L-1b: taken over as the first member of this lock's ZSET on success
      handed[i] = hv
      was_empty[i] = true
    elseif hv then
      -- held by a limit-1 holder, or handed to another job
      conflicts[#conflicts + 1] = lock1_conflict(lk, id, limit)
    else
      local holders = 0
      if not empty then holders = redis.call('ZCARD', lk) end
      was_empty[i] = (holders == 0)
      if holders > 0 and redis.call('ZSCORE', lk, '~' .. digest) then
        kept_for_me[i] = true
        holders = holders - 1
      end
      if holders >= limit then
        -- kept: the lock is full by this job's limit even without its own unit (L-1b)
        local first = redis.call('ZRANGE', lk, 0, 0, 'WITHSCORES')
        conflicts[#conflicts + 1] = {'lock', id, holders, limit, first[2] or '0',
          kept = kept_for_me[i]}
      end
    end
  end
end

-- D-5: a locked_by name blocks while its live count, less this digest's own enqueue-time hold,
-- is above zero.
local function is_enqueue_hold(name)
  for _, h in ipairs(enqueue_holds) do
    if h == name then return true end
  end
  return false
end
for _, name in ipairs(locked_by) do
  local now = now_ms()
  local total, counts, dropped = dep_state(prefix, name, now)
  if dropped > 0 then count(prefix, now, 'holds_expired', '', dropped) end
  local live = total
  if (counts[digest] or 0) > 0 and is_enqueue_hold(name) then
    live = live - 1
  end
  if live > 0 then
    local first = redis.call('ZSCORE', prefix .. 'deps', name) or '0'
    conflicts[#conflicts + 1] = {'dep', name, live, 0, first}
    dep_conflict = true
  end
end
for _, c in ipairs(rate_conflicts) do conflicts[#conflicts + 1] = c end

local sources = opt['sources'] or {}
local function source_json(i, id_json)
  return sources[i] and cjson.encode(sources[i]) or id_json
end
-- Each lock id as a JSON string, encoded once.
local id_jsons = {}
local function id_json_of(i, id)
  local j = id_jsons[i]
  if j == nil then
    j = cjson.encode(id)
    id_jsons[i] = j
  end
  return j
end

-- The job's payload, read once when needed (a conflict, or a handoff to check).
local payload_read = nil
local function job_payload()
  if payload_read == nil then payload_read = redis.call('HGET', inflight, 'payload') or false end
  return payload_read
end

-- L-1b: a limit-1 job that meets a larger lock's ZSET needs it to itself. Its expired
-- members go first; a unit kept there for this payload (lockn_handoff) does not count.
-- Returns "free" (the purge emptied it: take it as usual), "mine" (only this payload's unit
-- is left: the lock is taken over on success), "string" (the purge's wake handed it on as a
-- limit-1 lock: read its value again), or the conflict (`kept`: this payload has a unit in it).
local function lock1_on_zset(lk, id)
  local ik, bk = prefix .. 'lockinfo:' .. id, prefix .. 'blocked:lock:' .. id
  local now = now_ms()
  local purged = purge_expired(lk, ik, bk, now, counter_prefix)
  if purged > 0 then
    fix_lock(lk, ik, KEYS[6], id)
    count(prefix, now, 'expired', '', purged)
  end
  if known[lk] then return 'string' end
  local members = redis.pcall('ZCARD', lk)
  -- a key of another type counts as full
  if type(members) ~= 'number' then return lock1_conflict(lk, id, 1) end
  if members == 0 then return 'free' end
  local own = redis.call('ZSCORE', lk, '~' .. digest) ~= false
  if own and members == 1 then return 'mine' end
  local first = redis.call('ZRANGE', lk, 0, 0, 'WITHSCORES')
  return {'lock', id, members - (own and 1 or 0), 1, first[2] or '0', kept = own}
end

-- Limit-1 locks: SET NX PX takes each free one (their values were read with the lease, in
-- one MGET); if one is held, the ones just taken are deleted again in this step, so nobody saw
-- them (L-4). A lock handed to this job's digest by a release (PK-3, lib.lua lock1_handoff)
-- is taken over; if another lock is held, the handoff is put back. A larger lock's ZSET
-- whose only member is a unit kept for this payload is taken over on success (L-1b).
local taken = {}
local handoffs = {}
local fences = {}
local zset_mine = {}
-- Lock conflicts are reported before dependency ones, in lock order.
local nlock = 0
for _, c in ipairs(conflicts) do
  if c[1] == 'lock' then nlock = nlock + 1 end
end
local function lock_conflict(i, c)
  if c.kept then kept_for_me[i] = true end
  nlock = nlock + 1
  table.insert(conflicts, nlock, c)
end
for i = 1, n do
  local lk, id, limit = lock_at(i)
  if limit <= 1 then
    if #conflicts > 0 then
      -- Nothing is taken: each conflict is reported, and a unit kept for this payload is none.
      -- RL-2: a job refused by a rate takes no lock, not even one handed to it (PK-3): its
      -- unit is given on below.
      local hv = sget(lk)
      local z = nil
      if not hv and redis.call('EXISTS', lk) == 1 then
        z = lock1_on_zset(lk, id)
        if z == 'string' then hv = sget(lk) end
      end
      if handed_to_me(hv) then
        if #rate_conflicts > 0 then handed[i] = hv end
      elseif hv then
        lock_conflict(i, lock1_conflict(lk, id, 1))
      elseif type(z) == 'table' then
        lock_conflict(i, z)
      elseif z == 'mine' and #rate_conflicts > 0 then
        kept_for_me[i] = true
      end
    else
      local id_json = id_json_of(i, id)
      local fence, fence_field = nil, ''
      if opt['fencing'] then
        -- A number is handed out only to a holder that got the lock: taken back below.
        fence = redis.call('HINCRBY', prefix .. 'fence', id, 1)
        fence_field = ',"fence":' .. int(fence)
      end
      local v = lock1_value(id_json, source_json(i, id_json), fence_field)
      local hv = sget(lk)
      local z = nil
      if not hv then
        if redis.call('SET', lk, v, 'NX', 'PX', int(ttl)) then
          z = 'taken'
        else
          z = lock1_on_zset(lk, id)
          if z == 'free' and redis.call('SET', lk, v, 'NX', 'PX', int(ttl)) then z = 'taken' end
          if z == 'string' then hv = sget(lk) end
        end
      end
      if z == 'taken' then
        known[lk] = v
        taken[#taken + 1] = lk
        fences[i] = fence
      elseif z == 'mine' then
        zset_mine[i] = v
        fences[i] = fence
      elseif handed_to_me(hv) then
        -- PK-3: the unit was handed to this payload; the parked flag goes on with it.
        local nv = '{"blocked":' .. (lock1_parked(hv) and '2' or '0') .. string.sub(v, 13)
        redis.call('SET', lk, nv, 'PX', int(ttl))
        known[lk] = nv
        taken[#taken + 1] = lk
        handoffs[lk] = hv
        fences[i] = fence
      else
        if fence then redis.call('HINCRBY', prefix .. 'fence', id, -1) end
        lock_conflict(i, type(z) == 'table' and z or lock1_conflict(lk, id, 1))
      end
    end
  end
end
-- The limit-1 locks just taken are given back, as if never taken (L-4).
local function undo_taken()
  if #taken == 0 then return end
  redis.call('DEL', unpack(taken))
  for _, lk in ipairs(taken) do known[lk] = false end
  for lk, hv in pairs(handoffs) do
    redis.call('SET', lk, hv, 'PX', int(ttl))
    known[lk] = hv
  end
  for i, f in pairs(fences) do redis.call('HINCRBY', prefix .. 'fence', ARGV[13 + 2 * i], -1) end
end
if #conflicts > 0 then undo_taken() end

if #conflicts > 0 then
  -- The server's time, read only where a rule needs it (a delay's due time, the parked
  -- index's score); the counts of the job path need none.
  local now = nil
  local fallback = ARGV[5]
  if dep_conflict then fallback = opt['dep_fallback'] or 'delay' end
  -- RL-3: a job refused by a rate alone is parked on it until its time.
  if conflicts[1][1] == 'rate' then fallback = 'park' end
  -- PK-1, PK-7: the job parks on the first resource that refused it, unless its list holds
  -- another type (PK-6: the old path, requeue, instead) or is full (on_park_full).
  -- The entry is pushed first: its RPUSH is the check of the list's type (a refused push
  -- writes nothing) and its reply the list's length; a push past max_parked is taken back.
  local park_key, park_len, park_res = nil, 0, nil
  if fallback == 'park' then
    local c1 = conflicts[1]
    park_res = c1[1] .. ':' .. c1[2]
    park_key = prefix .. 'parked:' .. park_res
    local entry = {rid = ARGV[1], queue = queue, payload = job_payload(), parked_at = wnow,
      class = class, digest = digest, attempt = 1, ttl = ttl, limit = tonumber(c1[4]) or 0,
      unique = opt['unique']}
    if c1[7] then
      entry['period'] = tonumber(c1[7][3])
      entry['spread'] = (c1[7][4] == 1 or c1[7][4] == true) and 1 or 0
    end
    -- L-1b: a woken job that finds the lock full by its own limit even without the unit kept
    -- for it (it parked with a larger one) parks again at the head, first in line as it was,
    -- and gives its unit back (lib_park.lua unkeep_for_head): the next unit freed is its.
    local at_head = c1.kept and #rate_conflicts == 0
    park_len = redis.pcall(at_head and 'LPUSH' or 'RPUSH', park_key, cjson.encode(entry))
    if type(park_len) ~= 'number' then
      fallback = 'requeue'
    elseif park_len > tonumber(opt['max_parked'] or 100000) then
      redis.call(at_head and 'LPOP' or 'RPOP', park_key)
      fallback = opt['park_full'] or 'requeue'
      count(prefix, now, 'park_full', class)
    elseif at_head then
      unkeep_for_head(prefix, c1[2], digest)
    end
  end
  -- S-6: the keys this fallback may push to are checked before its first write.
  if fallback == 'requeue' then
    must_be('acquire', KEYS[2], 'list')
    must_be('acquire', KEYS[3], 'set')
  end
  local may_fail = fallback == 'fail' or
    (fallback == 'delay' and tonumber((opt['delay'] or {})['max_delays'] or 0) > 0)
  if may_fail and opt['failed_list'] then
    must_be('acquire', opt['failed_list'], 'list')
    if (opt['multi_name'] or '') ~= '' then must_be('acquire', opt['failed_queues'], 'set') end
  end
  -- RL-2, PK-3: a job refused by a rate takes no lock, not even a unit kept for it (a member
  -- of a larger lock's ZSET, or a limit-1 lock's handoff): the unit goes on to the next job
  -- parked on that lock, or is freed. (After the fallback's checks, so that a refusal above
  -- has changed nothing.)
  if #rate_conflicts > 0 then
    for i in pairs(kept_for_me) do
      local lk, id = lock_at(i)
      local ik = prefix .. 'lockinfo:' .. id
      redis.call('ZREM', lk, '~' .. digest)
      redis.call('HDEL', ik, '~' .. digest)
      fix_lock(lk, ik, KEYS[6], id)
      parked_wake_freed(lk, counter_prefix, 1)
    end
    for i, hv in pairs(handed) do
      local lk, id = lock_at(i)
      if not (lock1_parked(hv) and lock1_handoff(prefix, lk, id)) then
        redis.call('DEL', lk)
        known[lk] = false
      end
    end
  end
  local action, due, attempt = 'none', 0, 0
  count(prefix, now, 'conflict', class)
  if opt['last_wait'] then count(prefix, now, 'wait_timeout', class) end
  local payload = job_payload()
  local function fail(message)
    local rec = opt['failure'] or ''
    local a, b = string.find(rec, '"__LOCKET_CONFLICT__"', 1, true)
    if a then
      rec = string.sub(rec, 1, a - 1) .. cjson.encode(message) .. string.sub(rec, b + 1)
    end
    redis.call('RPUSH', opt['failed_list'], rec)
    if (opt['multi_name'] or '') ~= '' then
      redis.call('SADD', opt['failed_queues'], opt['multi_name'])
    end
    incr_later(opt['stat_failed'])
    incr_later(opt['stat_failed_by'])
    free_unit()
    redis.call('DEL', inflight)
    count(prefix, now, 'conflict_failed', class)
    -- U-2, U-3: a failed job holds no unique entry.
    if opt['unique'] then unique_entry.release(prefix, opt['unique'][1], digest, class) end
    action = 'failed'
  end
  local c1 = conflicts[1]
  local what
  if c1[1] == 'lock' then
    what = 'lock ' .. c1[2] .. ' is held by ' .. c1[3] .. ' of limit ' .. c1[4]
  elseif c1[1] == 'rate' then
    what = 'rate ' .. c1[2] .. ' allows no start before ' .. c1[5]
  else
    what = 'dependency ' .. c1[2] .. ' is held ' .. c1[3] .. ' time(s)'
  end
  if fallback == 'park' then
    -- PK-1: the entry was pushed above, before the record goes; nothing touches the queue,
    -- its counter or stat:*.
    free_unit()
    redis.call('DEL', inflight)
    if park_len == 1 then
      -- The janitor looks at the resource when its earliest holder's lease ends (PK-4).
      local due = tonumber(c1[5]) or 0
      if c1[6] then due = now_ms() + math.max(redis.call('PTTL', c1[6]), 0) end
      if due <= 0 then due = now_ms() end
      redis.pcall('ZADD', prefix .. 'parked', 'NX', int(due), park_res)
    end
    if c1[1] == 'lock' then lock1_mark_parked(prefix .. 'lock:' .. c1[2]) end
    redis.pcall('HINCRBY', prefix .. 'parked_queues', queue, 1)
    count(prefix, now, 'parked', class)
    -- RL-5: per class, fleet-wide, for /metrics: the count goes to `rate_stats` with the
    -- others (lib.lua flush_counts, or the worker's tally, src/store/tally.rs).
    if c1[1] == 'rate' then count(prefix, now, 'rate_limited', class) end
    action = 'parked'
  elseif fallback == 'requeue' then
    -- The copy is pushed before the record goes (S-6): if the push raises, the job stays
    -- reserved and is returned or recovered, never lost.
    redis.call('RPUSH', KEYS[2], payload)
    free_unit()
    redis.call('DEL', inflight)
    redis.call('SADD', KEYS[3], queue)
    known[KEYS[4]] = nil
    if redis.call('INCR', KEYS[4]) == 1 then
      redis.call('PEXPIRE', KEYS[4], ARGV[4])
    end
    for _, c in ipairs(conflicts) do
      if c[1] == 'lock' then lock1_flag(prefix .. 'lock:' .. c[2]) end
      if c[1] == 'rate' then count(prefix, now, 'rate_limited', class) end
      local bk = prefix .. 'blocked:' .. c[1] .. ':' .. c[2]
      redis.call('SADD', bk, queue)
      redis.call('PEXPIRE', bk, ARGV[4])
    end
    count(prefix, now, 'requeued', class)
    action = 'requeued'
  elseif fallback == 'discard' then
    free_unit()
    redis.call('DEL', inflight)
    count(prefix, now, 'discarded', class)
    if opt['unique'] then unique_entry.release(prefix, opt['unique'][1], digest, class) end
    action = 'discarded'
  elseif fallback == 'delay' then
    local d = opt['delay'] or {}
    local akey = prefix .. 'attempts'
    attempt = redis.call('HINCRBY', akey, digest, 1)
    redis.call('PEXPIRE', akey, 604800000)
    local max_delays = tonumber(d['max_delays'] or 0)
    if max_delays > 0 and attempt > max_delays then
      redis.call('HDEL', akey, digest)
      fail('gave up after ' .. max_delays .. ' delays (max_delays): ' .. what)
    else
      local base, cap = tonumber(d['base'] or 5000), tonumber(d['max'] or 300000)
      local wait = base * math.pow(2, math.min(attempt - 1, 40))
      if wait > cap then wait = cap end
      now = now_ms()
      due = now + math.floor(wait * (1 + tonumber(d['r'] or 0)))
      local member = cjson.encode({rid = ARGV[1], queue = queue, payload = payload,
        reason = conflicts[1][1], resource = conflicts[1][2], attempt = attempt,
        unique = opt['unique'], digest = opt['unique'] and digest or nil})
      redis.call('ZADD', prefix .. 'delayed', due, member)
      free_unit()
      redis.call('DEL', inflight)
      count(prefix, now, 'delayed', class)
      action = 'delayed'
    end
  elseif fallback == 'fail' then
    fail(what)
  elseif opt['wait'] then
    -- P-3: the wait policy keeps the reservation; recovery treats it like a reserved one.
    if redis.call('HGET', inflight, 'state') == 'reserved' then
      redis.call('HSET', inflight, 'state', 'waiting')
      count(prefix, now, 'waited', class)
    end
  end
  local out = {'conflict', action, due, attempt}
  for _, c in ipairs(conflicts) do
    for j = 1, 5 do out[#out + 1] = c[j] end
  end
  return out
end

-- RL-1: the start counts against every rate of the job, one SET per rate (a ZSET's three or
-- four commands above RATE_STRING_MAX, rate.lua), first of the success's writes: a string
-- log that holds another type (MGET read it as nil, and its SET NX refuses) undoes them and
-- the locks taken above, and raises (S-6).
if #rates > 0 then
  rate_record(prefix, rates, rate_logs, now_ms(), 'acquire', undo_taken, ARGV[1])
end

-- L-1b: a limit-1 job takes over a larger lock's ZSET whose only member is the unit kept for
-- it: the ZSET, its lockinfo and index entry go, and the lock becomes this job's STRING (`v`,
-- its value), flagged for the queues it blocked (A-14) and the jobs parked on it (PK-2).
local function lock1_from_zset(lk, id, v)
  local ik, bk = prefix .. 'lockinfo:' .. id, prefix .. 'blocked:lock:' .. id
  redis.call('DEL', lk, ik)
  redis.call('ZREM', KEYS[6], id)
  local flag = redis.call('EXISTS', bk) + 2 * redis.call('EXISTS', prefix .. 'parked:lock:' .. id)
  local nv = '{"blocked":' .. int(flag) .. string.sub(v, 13)
  redis.call('SET', lk, nv, 'PX', int(ttl))
  known[lk] = nv
end

-- Success: the locks of a larger limit get their holder, lockinfo, expiries and index entry.
local deadline = wnow + ttl
local ids = {}
local out = {'ok', 0}
for i = 1, n do
  local lk, id, limit = lock_at(i)
  local id_json = id_json_of(i, id)
  ids[#ids + 1] = id_json
  if zset_mine[i] then
    lock1_from_zset(lk, id, zset_mine[i])
  elseif limit > 1 then
    local ik = prefix .. 'lockinfo:' .. id
    local now = now_ms()
    deadline = now + ttl
    local info = info_sep .. info_inner .. ',"acquired_at":' .. int(now) .. ',"extended_at":' ..
      int(now) .. ',"limit":' .. int(limit) .. ',"lock_id":' .. id_json .. ',"lock_id_source":' ..
      source_json(i, id_json)
    if kept_for_me[i] then
      redis.call('ZREM', lk, '~' .. digest)
      redis.call('HDEL', ik, '~' .. digest)
    end
    if handed[i] then
      -- L-1b: the limit-1 handoff to this payload becomes this job's unit of the ZSET.
      redis.call('DEL', lk)
      known[lk] = false
    end
    redis.call('ZADD', lk, int(deadline), ARGV[2])
    if opt['fencing'] then
      local f = redis.call('HINCRBY', prefix .. 'fence', id, 1)
      info = info .. ',"fence":' .. int(f)
      fences[i] = f
    end
    redis.call('HSET', ik, ARGV[2], '{' .. string.sub(info, 2) .. '}')
    if was_empty[i] then
      fix_sole_holder(lk, ik, KEYS[6], id, deadline)
    else
      fix_lock(lk, ik, KEYS[6], id)
    end
    -- L-1b, PK-2: jobs parked behind the handoff wake for the units this job's limit leaves.
    if handed[i] and lock1_parked(handed[i]) then
      parked_wake_freed(lk, counter_prefix, limit - 1)
    end
  end
end
out[2] = deadline
local fence_list = {}
for i = 1, n do
  if fences[i] then
    fence_list[#fence_list + 1] = fences[i]
    out[#out + 1] = fences[i]
  end
end

-- D-9 start-time holds, after the locked_by check; D-4 enqueue-time holds ensured.
local holds = {}
local hold_ttl = tonumber(opt['hold_ttl'] or 86400000)
local now = nil
if #start_holds > 0 or #enqueue_holds > 0 then now = now_ms() end
for _, name in ipairs(start_holds) do
  hold_add(prefix, name, digest, hold_ttl, now)
  holds[#holds + 1] = name
end
for _, name in ipairs(enqueue_holds) do
  local _, d = dep_field(redis.call('HGET', prefix .. 'dep:' .. name, digest))
  if d <= now then
    hold_add(prefix, name, digest, hold_ttl, now)
    count(prefix, now, 'holds_added', class)
  end
  holds[#holds + 1] = name
end
count(prefix, now, 'holds_added', class, #start_holds)

start_job(ids, holds, fence_list, now)
if opt['attempts'] then redis.call('HDEL', prefix .. 'attempts', digest) end
-- U-2, U-3: the record knows the job's unique entry (recovery runs without the worker); an
-- until_executing entry ends here, as the job now runs.
local u = opt['unique']
if u then
  redis.call('HSET', inflight, 'unique', cjson.encode(u))
  if u[2] == 'until_executing' then unique_entry.release(prefix, u[1], digest, class) end
end
return out
