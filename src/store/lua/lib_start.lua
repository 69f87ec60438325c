-- ACQUIRE's success (acquire.lua; locking-semantics.md A-8, L-1b, L-10, D-4, D-9, PK-2,
-- U-2, U-3): the locks of a larger limit get their holder, the holds are added, and the job
-- starts (acq.start_job, lib_acquire.lua). Functions of the step's state `a` (acq.new).

-- L-1b: a limit-1 job takes over a larger lock's ZSET whose only member is the unit kept for
-- it: the ZSET, its lockinfo and index entry go, and the lock becomes this job's STRING (`v`,
-- its value), flagged for the queues it blocked (A-14) and the jobs parked on it (PK-2).
function acq.lock1_from_zset(a, lk, id, v)
  local prefix = a.prefix
  local ik, bk = prefix .. 'lockinfo:' .. id, prefix .. 'blocked:lock:' .. id
  redis.call('DEL', lk, ik)
  redis.call('ZREM', a.K[6], id)
  local flag = redis.call('EXISTS', bk) + 2 * redis.call('EXISTS', prefix .. 'parked:lock:' .. id)
  local nv = '{"blocked":' .. int(flag) .. string.sub(v, 13)
  redis.call('SET', lk, nv, 'PX', int(a.ttl))
  known[lk] = nv
end

-- Lock i of a larger limit gets this job as a holder: its ZSET member, lockinfo field (with
-- its fence number, L-10), expiry and index entry. A unit kept for this payload, or the
-- limit-1 handoff to it, becomes its unit (L-1b); jobs parked behind the handoff wake for the
-- units this job's limit leaves (PK-2). Returns the lock's deadline.
function acq.hold_larger_lock(a, i, lk, id, limit, id_json)
  local prefix, ttl = a.prefix, a.ttl
  local ik = prefix .. 'lockinfo:' .. id
  local now = now_ms()
  local deadline = now + ttl
  local info = a.info_sep .. a.info_inner .. ',"acquired_at":' .. int(now) ..
    ',"extended_at":' .. int(now) .. ',"limit":' .. int(limit) .. ',"lock_id":' .. id_json ..
    ',"lock_id_source":' .. acq.source_json(a, i, id_json)
  if a.kept_for_me[i] then
    local m = acq.kept_member(a, lk)
    redis.call('ZREM', lk, m)
    redis.call('HDEL', ik, m)
  end
  if a.handed[i] then
    -- L-1b: the limit-1 handoff to this payload becomes this job's unit of the ZSET.
    redis.call('DEL', lk)
    known[lk] = false
  end
  redis.call('ZADD', lk, int(deadline), a.A[2])
  if a.opt['fencing'] then
    local f = redis.call('HINCRBY', prefix .. 'fence', id, 1)
    info = info .. ',"fence":' .. int(f)
    a.fences[i] = f
  end
  redis.call('HSET', ik, a.A[2], '{' .. string.sub(info, 2) .. '}')
  if a.was_empty[i] then
    fix_sole_holder(lk, ik, a.K[6], id, deadline)
  else
    fix_lock(lk, ik, a.K[6], id)
  end
  if a.handed[i] and lock1_parked(a.handed[i]) then
    parked_wake_freed(lk, a.counter_prefix, limit - 1)
  end
  return deadline
end

-- Success: every lock is this job's. Returns the locks' ids (JSON strings), the reply
-- {"ok", deadline_ms, fence...} and the fence numbers as a list.
function acq.hold_locks(a)
  local deadline = a.wnow + a.ttl
  local ids = {}
  local out = {'ok', 0}
  for i = 1, a.n do
    local lk, id, limit = acq.lock_at(a, i)
    local id_json = acq.id_json_of(a, i, id)
    ids[#ids + 1] = id_json
    if a.zset_mine[i] then
      acq.lock1_from_zset(a, lk, id, a.zset_mine[i])
    elseif limit > 1 then
      deadline = acq.hold_larger_lock(a, i, lk, id, limit, id_json)
    end
  end
  out[2] = deadline
  local fence_list = {}
  for i = 1, a.n do
    if a.fences[i] then
      fence_list[#fence_list + 1] = a.fences[i]
      out[#out + 1] = a.fences[i]
    end
  end
  return ids, out, fence_list
end

-- D-9 start-time holds, after the locked_by check; D-4 enqueue-time holds ensured. Returns
-- the holds' names and the server time when it was read (else nil).
function acq.add_holds(a)
  local prefix, digest, class = a.prefix, a.digest, a.class
  local holds = {}
  local hold_ttl = tonumber(a.opt['hold_ttl'] or 86400000)
  local now = nil
  if #a.start_holds > 0 or #a.enqueue_holds > 0 then now = now_ms() end
  for _, name in ipairs(a.start_holds) do
    hold_add(prefix, name, digest, hold_ttl, now)
    holds[#holds + 1] = name
  end
  for _, name in ipairs(a.enqueue_holds) do
    local _, d = dep_field(redis.call('HGET', prefix .. 'dep:' .. name, digest))
    if d <= now then
      hold_add(prefix, name, digest, hold_ttl, now)
      count(prefix, now, 'holds_added', class)
    end
    holds[#holds + 1] = name
  end
  count(prefix, now, 'holds_added', class, #a.start_holds)
  return holds, now
end

-- After START: A-8, the delay attempts of the digest go; U-2, U-3, the record knows the job's
-- unique entry (recovery runs without the worker), and an until_executing entry ends here, as
-- the job now runs.
function acq.after_start(a)
  local opt = a.opt
  if opt['attempts'] then redis.call('HDEL', a.prefix .. 'attempts', a.digest) end
  local u = opt['unique']
  if u then
    redis.call('HSET', a.inflight, 'unique', cjson.encode(u))
    if u[2] == 'until_executing' then unique_entry.release(a.prefix, u[1], a.digest, a.class) end
  end
end
