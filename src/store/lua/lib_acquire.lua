-- ACQUIRE's steps (acquire.lua; locking-semantics.md A-6..A-8, A-21, A-22, L-1b, L-4, L-10,
-- D-4, D-5, D-9; rate-limits.md RL-1, RL-2), each named for its rule and a function of the
-- step's state `a` (acq.new: KEYS and ARGV as acquire.lua's header names them, and what the
-- checks find). acquire.lua composes them; the conflict policies are in lib_conflict.lua.
-- Only the job-path scripts and their FUNCTION library include this file (scripts.rs).
local acq = {}

-- A-7a: set by TAKE (take.lua) around its ACQUIRE: the job's payload, which TAKE has in hand,
-- and its digest, worked out only when a handoff from an earlier version needs it
-- (acq.digest_of): TAKE sends no digest.
acq.take_payload = nil
acq.digest_later = nil

-- The step's state: its keys and arguments, and the lockinfo object's fields. The lockinfo
-- object gets its times and per-lock fields appended as text (the object from the worker holds
-- none of them), which spares a cjson decode and encode per lock. Its fields without the
-- braces, and the comma that goes before them, are cut once per call; each value is then made
-- by one concatenation (every string Lua makes is hashed byte by byte here, and the limit-1
-- lock's value is the job path's longest).
function acq.new(KEYS, ARGV)
  local a = {K = KEYS, A = ARGV, inflight = KEYS[1], n = (#ARGV - 14) / 2,
    ttl = tonumber(ARGV[3]), counter_prefix = ARGV[8], wnow = tonumber(ARGV[13]) or 0,
    queue = ARGV[9], class = ARGV[10], digest = ARGV[11]}
  a.prefix = locket_prefix(a.counter_prefix)
  a.info_inner = string.sub(ARGV[7], 2, -2)
  a.info_sep = (a.info_inner ~= '') and ',' or ''
  return a
end

-- A-22: a job that leaves its reservation in a conflict path frees its queue's unit
-- (redis.pcall: a set spoiled by hand is left to the janitor, never a half-done step).
function acq.free_unit(a)
  local A = a.A
  if sget(a.prefix .. 'cap:' .. A[9]) then
    redis.pcall('SREM', a.prefix .. 'running:' .. A[9], A[1] .. ' ' .. a.inflight)
  end
end

-- R-6, R-2: whether the reservation is still this slot's and its process alive. While the
-- lease is held only this process writes its slot record, so a first call needs no rid check
-- (lib.lua, lease_trusted). A call sent again, or one whose lease is gone, reads it. Returns
-- the reply that ends the step ("missing", "dead", or a retried call's "ok"), else nil.
function acq.check_reservation(a)
  local A, inflight = a.A, a.inflight
  local alive = lease_held(a.prefix, inflight)
  if A[14] == '1' or not lease_trusted(a.prefix, inflight) then
    local rec = redis.call('HMGET', inflight, 'rid', 'token', 'state')
    if rec[1] ~= A[1] then
      return {'missing'}
    end
    -- A retry after a lost reply: this attempt already started; answer as the first call did.
    if rec[2] == A[2] and rec[3] == 'running' then
      local out = {'ok', a.wnow + a.ttl}
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
  return nil
end

-- A limit-1 lock's value, this attempt's: {"blocked":0,"token":"<token>",<holder fields>,
-- "acquired_at":..,"limit":1,"lock_id":..,"lock_id_source":..[,"fence":..]} (lib_lock.lua).
function acq.lock1_value(a, id_json, source, fence_field)
  return LOCK1_HEAD .. a.A[2] .. '"' .. a.info_sep .. a.info_inner .. ',"acquired_at":' ..
    int(a.wnow) .. ',"limit":1,"lock_id":' .. id_json .. ',"lock_id_source":' .. source ..
    fence_field .. '}'
end

-- START (A-8): the job runs; work could be done in q, so its counter restarts. `ids` are the
-- locks' ids as JSON strings; `holds` and `fence_list` lists, or nil for none; `now` the
-- server time when this step read it, else nil (count reads it only if it needs it).
function acq.start_job(a, ids, holds, fence_list, now)
  local K, A, inflight = a.K, a.A, a.inflight
  redis.call('HSET', inflight,
    'state', 'running',
    'started_at', int(a.wnow),
    'token', A[2],
    'locks', '[' .. table.concat(ids, ',') .. ']',
    'class', a.class,
    'digest', a.digest)
  if holds and #holds > 0 then redis.call('HSET', inflight, 'holds', cjson.encode(holds)) end
  if fence_list and #fence_list > 0 then
    redis.call('HSET', inflight, 'fences', cjson.encode(fence_list))
  end
  redis.call('SET', K[5], A[6])
  clear_counter(K[4])
  if a.n > 0 then count(a.prefix, now, 'acquired', a.class) end
  count(a.prefix, now, 'started', a.class)
end

-- The plain case, in few steps: no options (no holds, rates, fencing, sources or wait), every
-- lock of limit 1 and, by the step's MGET, free. Each lock is taken by SET NX PX with the
-- value the full path writes, then the job starts as it starts there. A SET NX that finds a
-- key anyway (one of another type: MGET reads it as absent) gives back the locks just taken
-- and hands the step to the full path, which settles the conflict. Returns whether it started.
function acq.plain(a)
  local K, A, n = a.K, a.A, a.n
  for i = 1, n do
    if tonumber(A[14 + 2 * i]) > 1 or known[K[6 + i]] ~= false then return false end
  end
  local ids = {}
  local got = 0
  for i = 1, n do
    local lk = K[6 + i]
    local id_json = cjson.encode(A[13 + 2 * i])
    ids[i] = id_json
    local v = acq.lock1_value(a, id_json, id_json, '')
    if not redis.call('SET', lk, v, 'NX', 'PX', int(a.ttl)) then break end
    known[lk] = v
    got = i
  end
  if got == n then
    acq.start_job(a, ids, nil, nil, nil)
    return true
  end
  -- Not all taken: the ones taken go back, as if never taken (L-4).
  for i = 1, got do
    redis.call('DEL', K[6 + i])
    known[K[6 + i]] = false
  end
  return false
end

-- The full path's options (ARGV[12]) and the tables its checks fill.
function acq.options(a)
  local opt = {}
  if a.A[12] ~= '' then opt = cjson.decode(a.A[12]) end
  a.opt = opt
  a.locked_by = opt['locked_by'] or {}
  a.enqueue_holds = opt['enqueue_holds'] or {}
  a.start_holds = opt['start_holds'] or {}
  a.rates = opt['rates'] or {}
  a.sources = opt['sources'] or {}
  a.rate_logs, a.rate_conflicts = {}, {}
  a.conflicts, a.dep_conflict = {}, false
  -- per lock i: whether its ZSET was empty; a unit kept for this payload in it (PK-3,
  -- lockn_handoff); the lock handed to it as a limit-1 lock (its STRING value). Either of the
  -- last two is this job's to take over whatever its own limit (L-1b), and neither counts
  -- against it.
  a.was_empty, a.kept_for_me, a.handed = {}, {}, {}
  a.id_jsons = {}
  a.payload_read = acq.take_payload
  -- PK-3: the member of each larger lock kept for this job, by lock key (acq.kept_unit), and
  -- this job's handoff key (acq.unit_key)
  a.members, a.unit = {}, nil
  -- the limit-1 locks taken, the handoffs they replaced, the fence numbers handed out, and
  -- the limit-1 locks taken over from a ZSET of only this payload's unit (L-1b)
  a.taken, a.handoffs, a.fences, a.zset_mine = {}, {}, {}, {}
end

-- Lock i's key, id and limit.
function acq.lock_at(a, i)
  return a.K[6 + i], a.A[13 + 2 * i], tonumber(a.A[14 + 2 * i])
end

-- Lock i's lock_id_source (T-5) as JSON, its id's when no source was rendered.
function acq.source_json(a, i, id_json)
  return a.sources[i] and cjson.encode(a.sources[i]) or id_json
end

-- Each lock id as a JSON string, encoded once.
function acq.id_json_of(a, i, id)
  local j = a.id_jsons[i]
  if j == nil then
    j = cjson.encode(id)
    a.id_jsons[i] = j
  end
  return j
end

-- The job's payload, read once when needed (a conflict, or a handoff to check).
function acq.job_payload(a)
  if a.payload_read == nil then
    a.payload_read = redis.call('HGET', a.inflight, 'payload') or false
  end
  return a.payload_read
end

-- RL-1, RL-2: the rates are read first, before any write of this step (a log of another type
-- raises here, having changed nothing); a refusal is a conflict like a lock's, so no lock is
-- taken, and a lock's refusal records no start. The logs came with the step's MGET
-- (rate.lua): reading them costs no command.
function acq.check_rates(a)
  for i, r in ipairs(a.rates) do
    local at, l = rate_allowed_at(a.prefix, r, now_ms(), 'acquire')
    a.rate_logs[i] = l
    if at > now_ms() then
      local full = l.full
      a.rate_conflicts[#a.rate_conflicts + 1] = {'rate', r[1], full and int(r[2]) or 0,
        int(r[2]), int(at), nil, r}
    end
  end
end

-- A conflict on a lock whose key is a limit-1 holder's STRING (or, for a limit-1 lock, a
-- larger lock's ZSET, which counts as full too): its holders, the limit asked for, and its
-- deadline from the key's PTTL. With the park policy the deadline is read only when the
-- parked index needs it (the reply then says 0).
function acq.lock1_conflict(a, lk, id, limit)
  local holders = 1
  if not sget(lk) then
    holders = tonumber(redis.pcall('ZCARD', lk)) or 1
  end
  if a.A[5] == 'park' then return {'lock', id, holders, limit, '0', lk} end
  local left = redis.call('PTTL', lk)
  return {'lock', id, holders, limit, int(now_ms() + math.max(left, 0))}
end

-- PK-3: this job's handoff key, the SHA1 of its payload's bytes (lib_park.lua unit_key:
-- Redis's own SHA1, so a park and a take-over cost no hashing in Lua).
function acq.unit_key(a)
  if a.unit == nil then a.unit = redis.sha1hex(acq.job_payload(a) or '') end
  return a.unit
end

-- The job's digest: sent by the worker, or worked out for TAKE (acq.digest_later), which
-- sends none.
function acq.digest_of(a)
  if a.digest == '' and acq.digest_later then a.digest = acq.digest_later() end
  return a.digest
end

-- PK-3, L-1b: whether a limit-1 lock's value is a handoff to this job's payload
-- (lib_park.lua lock1_hand: "~<SHA1 of the payload>" in place of the token; an earlier
-- version's handoff has the job's 64-digit digest there).
function acq.handed_to_me(a, hv)
  if not (hv and string.sub(hv, 23, 23) == '~') then return false end
  if string.sub(hv, 64, 64) == '"' then
    return string.sub(hv, 24, 63) == acq.unit_key(a)
  end
  local d = acq.digest_of(a)
  return d ~= '' and string.sub(hv, 24, 24 + #d) == d .. '"'
end

-- PK-3: whether the larger lock `lk` keeps a unit for this job (lockn_handoff): its member
-- "~<SHA1 of the payload>", or, kept by an earlier version, "~<digest>" (looked for when the
-- worker sent the digest). The member found is kept in a.members for the step's ZREM.
function acq.kept_unit(a, lk)
  local m = '~' .. acq.unit_key(a)
  if redis.call('ZSCORE', lk, m) then
    a.members[lk] = m
    return true
  end
  if a.digest ~= '' and redis.call('ZSCORE', lk, '~' .. a.digest) then
    a.members[lk] = '~' .. a.digest
    return true
  end
  return false
end

-- Whether any lock of the job has a limit above 1.
function acq.holds_larger(a)
  for i = 1, a.n do
    if tonumber(a.A[14 + 2 * i]) > 1 then return true end
  end
  return false
end

-- The member kept for this job in larger lock `lk`, to remove or give on.
function acq.kept_member(a, lk)
  return a.members[lk] or ('~' .. acq.unit_key(a))
end

-- L-4: every lock of a larger limit is purged and counted first: all or nothing. Every
-- conflicting one is reported.
function acq.check_larger_locks(a)
  local prefix, conflicts = a.prefix, a.conflicts
  for i = 1, a.n do
    local lk, id, limit = acq.lock_at(a, i)
    if limit > 1 then
      local ik, bk = prefix .. 'lockinfo:' .. id, prefix .. 'blocked:lock:' .. id
      local now = now_ms()
      local hv = sget(lk)
      local empty = true
      if not hv then
        local purged
        purged, empty = purge_expired(lk, ik, bk, now, a.counter_prefix)
        if purged > 0 then
          fix_lock(lk, ik, a.K[6], id)
          count(prefix, now, 'expired', '', purged)
        end
        -- The purge's wake may have handed the lock to a parked limit-1 job (L-1b).
        hv = sget(lk)
      end
      if acq.handed_to_me(a, hv) then
        -- L-1b: taken over as the first member of this lock's ZSET on success
        a.handed[i] = hv
        a.was_empty[i] = true
      elseif hv then
        -- held by a limit-1 holder, or handed to another job
        conflicts[#conflicts + 1] = acq.lock1_conflict(a, lk, id, limit)
      else
        local holders = 0
        if not empty then holders = redis.call('ZCARD', lk) end
        a.was_empty[i] = (holders == 0)
        if holders > 0 and acq.kept_unit(a, lk) then
          a.kept_for_me[i] = true
          holders = holders - 1
        end
        if holders >= limit then
          -- kept: the lock is full by this job's limit even without its own unit (L-1b)
          local first = redis.call('ZRANGE', lk, 0, 0, 'WITHSCORES')
          conflicts[#conflicts + 1] = {'lock', id, holders, limit, first[2] or '0',
            kept = a.kept_for_me[i]}
        end
      end
    end
  end
end

-- D-5: a locked_by name blocks while its live count, less this digest's own enqueue-time hold,
-- is above zero.
function acq.check_locked_by(a)
  local prefix, conflicts = a.prefix, a.conflicts
  for _, name in ipairs(a.locked_by) do
    local now = now_ms()
    local total, counts, dropped = dep_state(prefix, name, now)
    if dropped > 0 then count(prefix, now, 'holds_expired', '', dropped) end
    local live = total
    if (counts[a.digest] or 0) > 0 and acq.is_enqueue_hold(a, name) then
      live = live - 1
    end
    if live > 0 then
      local first = redis.call('ZSCORE', prefix .. 'deps', name) or '0'
      conflicts[#conflicts + 1] = {'dep', name, live, 0, first}
      a.dep_conflict = true
    end
  end
end

function acq.is_enqueue_hold(a, name)
  for _, h in ipairs(a.enqueue_holds) do
    if h == name then return true end
  end
  return false
end

-- L-1b: a limit-1 job that meets a larger lock's ZSET needs it to itself. Its expired
-- members go first; a unit kept there for this payload (lockn_handoff) does not count.
-- Returns "free" (the purge emptied it: take it as usual), "mine" (only this payload's unit
-- is left: the lock is taken over on success), "string" (the purge's wake handed it on as a
-- limit-1 lock: read its value again), or the conflict (`kept`: this payload has a unit in it).
function acq.lock1_on_zset(a, lk, id)
  local prefix = a.prefix
  local ik, bk = prefix .. 'lockinfo:' .. id, prefix .. 'blocked:lock:' .. id
  local now = now_ms()
  local purged = purge_expired(lk, ik, bk, now, a.counter_prefix)
  if purged > 0 then
    fix_lock(lk, ik, a.K[6], id)
    count(prefix, now, 'expired', '', purged)
  end
  if known[lk] then return 'string' end
  local members = redis.pcall('ZCARD', lk)
  -- a key of another type counts as full
  if type(members) ~= 'number' then return acq.lock1_conflict(a, lk, id, 1) end
  if members == 0 then return 'free' end
  local own = acq.kept_unit(a, lk)
  if own and members == 1 then return 'mine' end
  local first = redis.call('ZRANGE', lk, 0, 0, 'WITHSCORES')
  return {'lock', id, members - (own and 1 or 0), 1, first[2] or '0', kept = own}
end

-- A lock conflict found among the limit-1 locks: reported before the dependency ones, in lock
-- order (a.nlock: the lock conflicts so far).
function acq.lock_conflict(a, i, c)
  if c.kept then a.kept_for_me[i] = true end
  a.nlock = a.nlock + 1
  table.insert(a.conflicts, a.nlock, c)
end

-- While a conflict is already found, nothing is taken: each limit-1 lock's conflict is
-- reported, and a unit kept for this payload is none. RL-2: a job refused by a rate takes no
-- lock, not even one handed to it (PK-3): its unit is given on (lib_conflict.lua).
function acq.note_limit1_lock(a, i, lk, id)
  local hv = sget(lk)
  local z = nil
  if not hv and redis.call('EXISTS', lk) == 1 then
    z = acq.lock1_on_zset(a, lk, id)
    if z == 'string' then hv = sget(lk) end
  end
  if acq.handed_to_me(a, hv) then
    if #a.rate_conflicts > 0 then a.handed[i] = hv end
  elseif hv then
    acq.lock_conflict(a, i, acq.lock1_conflict(a, lk, id, 1))
  elseif type(z) == 'table' then
    acq.lock_conflict(a, i, z)
  elseif z == 'mine' and #a.rate_conflicts > 0 then
    a.kept_for_me[i] = true
  end
end

-- L-4, L-10: limit-1 lock i taken by SET NX PX (its value was read with the lease, in one
-- MGET), with its fence number when fencing; a lock handed to this job's digest by a release
-- (PK-3, lib_park.lua lock1_handoff) is taken over; a larger lock's ZSET whose only member
-- is a unit kept for this payload is taken over on success (L-1b). A held lock is a conflict.
function acq.take_limit1_lock(a, i, lk, id)
  local prefix, ttl = a.prefix, a.ttl
  local id_json = acq.id_json_of(a, i, id)
  local fence, fence_field = nil, ''
  if a.opt['fencing'] then
    -- A number is handed out only to a holder that got the lock: taken back below.
    fence = redis.call('HINCRBY', prefix .. 'fence', id, 1)
    fence_field = ',"fence":' .. int(fence)
  end
  local v = acq.lock1_value(a, id_json, acq.source_json(a, i, id_json), fence_field)
  local hv = sget(lk)
  local z = nil
  if not hv then
    if redis.call('SET', lk, v, 'NX', 'PX', int(ttl)) then
      z = 'taken'
    else
      z = acq.lock1_on_zset(a, lk, id)
      if z == 'free' and redis.call('SET', lk, v, 'NX', 'PX', int(ttl)) then z = 'taken' end
      if z == 'string' then hv = sget(lk) end
    end
  end
  if z == 'taken' then
    known[lk] = v
    a.taken[#a.taken + 1] = lk
    a.fences[i] = fence
  elseif z == 'mine' then
    a.zset_mine[i] = v
    a.fences[i] = fence
  elseif acq.handed_to_me(a, hv) then
    -- PK-3: the unit was handed to this payload; the parked flag goes on with it.
    local nv = '{"blocked":' .. (lock1_parked(hv) and '2' or '0') .. string.sub(v, 13)
    redis.call('SET', lk, nv, 'PX', int(ttl))
    known[lk] = nv
    a.taken[#a.taken + 1] = lk
    a.handoffs[lk] = hv
    a.fences[i] = fence
  else
    if fence then redis.call('HINCRBY', prefix .. 'fence', id, -1) end
    acq.lock_conflict(a, i, type(z) == 'table' and z or acq.lock1_conflict(a, lk, id, 1))
  end
end

-- Limit-1 locks, in order: taken while no conflict is found, noted once one is; the ones
-- taken are given back when any conflict is found (acq.undo_taken), so nobody saw them (L-4).
function acq.take_limit1_locks(a)
  a.nlock = 0
  for _, c in ipairs(a.conflicts) do
    if c[1] == 'lock' then a.nlock = a.nlock + 1 end
  end
  for i = 1, a.n do
    local lk, id, limit = acq.lock_at(a, i)
    if limit <= 1 then
      if #a.conflicts > 0 then
        acq.note_limit1_lock(a, i, lk, id)
      else
        acq.take_limit1_lock(a, i, lk, id)
      end
    end
  end
end

-- L-4: the limit-1 locks just taken are given back, as if never taken: deleted, the handoffs
-- they replaced put back, and their fence numbers taken back.
function acq.undo_taken(a)
  if #a.taken == 0 then return end
  redis.call('DEL', unpack(a.taken))
  for _, lk in ipairs(a.taken) do known[lk] = false end
  for lk, hv in pairs(a.handoffs) do
    redis.call('SET', lk, hv, 'PX', int(a.ttl))
    known[lk] = hv
  end
  for i, f in pairs(a.fences) do
    redis.call('HINCRBY', a.prefix .. 'fence', a.A[13 + 2 * i], -1)
  end
end
