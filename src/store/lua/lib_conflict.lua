-- ACQUIRE's conflict policies (acquire.lua; locking-semantics.md P-1..P-5, A-14, A-22, S-6,
-- PK-1, PK-3, PK-6, PK-7, L-1b; rate-limits.md RL-2, RL-3, RL-5; U-2..U-4): a job that did not
-- get every lock, rate and locked_by name is settled in the same step by its fallback. Each
-- policy is a function of the step's state `a` (acq.new, lib_acquire.lua) that sets a.action
-- (and a.due, a.attempt); acq.settle composes them and makes the reply.

-- The fallback: a locked_by conflict's own (dep_fallback, default delay) wins over ARGV[5];
-- RL-3: a job refused by a rate alone is parked on it until its time.
function acq.fallback(a)
  local fallback = a.A[5]
  if a.dep_conflict then fallback = a.opt['dep_fallback'] or 'delay' end
  if a.conflicts[1][1] == 'rate' then fallback = 'park' end
  return fallback
end

-- PK-1, PK-7: the job parks on the first resource that refused it, unless its list holds
-- another type (PK-6: the old path, requeue, instead) or is full (park_full). The entry is
-- pushed first: its RPUSH is the check of the list's type (a refused push writes nothing) and
-- its reply the list's length; a push past max_parked is taken back. Returns the fallback
-- left to run; a.park_len and a.park_res say where the entry went.
function acq.park_entry(a)
  local prefix, opt, c1 = a.prefix, a.opt, a.conflicts[1]
  a.park_res = c1[1] .. ':' .. c1[2]
  local park_key = prefix .. 'parked:' .. a.park_res
  local entry = {rid = a.A[1], queue = a.queue, payload = acq.job_payload(a),
    parked_at = a.wnow, class = a.class, digest = a.digest ~= '' and a.digest or nil,
    attempt = 1, ttl = a.ttl,
    limit = tonumber(c1[4]) or 0, unique = opt['unique']}
  if c1[7] then
    entry['period'] = tonumber(c1[7][3])
    entry['spread'] = (c1[7][4] == 1 or c1[7][4] == true) and 1 or 0
  end
  -- L-1b: a woken job that finds the lock full by its own limit even without the unit kept
  -- for it (it parked with a larger one) parks again at the head, first in line as it was,
  -- and gives its unit back (lib_park.lua unkeep_for_head): the next unit freed is its.
  local at_head = c1.kept and #a.rate_conflicts == 0
  local park_len = redis.pcall(at_head and 'LPUSH' or 'RPUSH', park_key, cjson.encode(entry))
  a.park_len = park_len
  if type(park_len) ~= 'number' then
    return 'requeue'
  elseif park_len > tonumber(opt['max_parked'] or 100000) then
    redis.call(at_head and 'LPOP' or 'RPOP', park_key)
    count(prefix, a.now, 'park_full', a.class)
    return opt['park_full'] or 'requeue'
  elseif at_head then
    unkeep_for_head(prefix, c1[2], acq.kept_member(a, prefix .. 'lock:' .. c1[2]))
  end
  return 'park'
end

-- S-6: the keys this fallback may push to are checked before its first write.
function acq.check_fallback_keys(a, fallback)
  local opt = a.opt
  if fallback == 'requeue' then
    must_be('acquire', a.K[2], 'list')
    must_be('acquire', a.K[3], 'set')
  end
  local may_fail = fallback == 'fail' or
    (fallback == 'delay' and tonumber((opt['delay'] or {})['max_delays'] or 0) > 0)
  if may_fail and opt['failed_list'] then
    must_be('acquire', opt['failed_list'], 'list')
    if (opt['multi_name'] or '') ~= '' then must_be('acquire', opt['failed_queues'], 'set') end
  end
end

-- RL-2, PK-3: a job refused by a rate takes no lock, not even a unit kept for it (a member of
-- a larger lock's ZSET, or a limit-1 lock's handoff): the unit goes on to the next job parked
-- on that lock, or is freed.
function acq.give_back_units(a)
  local prefix = a.prefix
  for i in pairs(a.kept_for_me) do
    local lk, id = acq.lock_at(a, i)
    local ik = prefix .. 'lockinfo:' .. id
    local m = acq.kept_member(a, lk)
    redis.call('ZREM', lk, m)
    redis.call('HDEL', ik, m)
    fix_lock(lk, ik, a.K[6], id)
    parked_wake_freed(lk, a.counter_prefix, 1)
  end
  for i, hv in pairs(a.handed) do
    local lk, id = acq.lock_at(a, i)
    if not (lock1_parked(hv) and lock1_handoff(prefix, lk, id)) then
      redis.call('DEL', lk)
      known[lk] = false
    end
  end
end

-- The first conflict in words, for a failure record.
function acq.conflict_text(c1)
  if c1[1] == 'lock' then
    return 'lock ' .. c1[2] .. ' is held by ' .. c1[3] .. ' of limit ' .. c1[4]
  elseif c1[1] == 'rate' then
    return 'rate ' .. c1[2] .. ' allows no start before ' .. c1[5]
  end
  return 'dependency ' .. c1[2] .. ' is held ' .. c1[3] .. ' time(s)'
end

-- P-1 "fail": a Resque failure record with `message` as its error; the job leaves. U-2, U-3:
-- a failed job holds no unique entry.
function acq.fail(a, message)
  local prefix, opt = a.prefix, a.opt
  local rec = opt['failure'] or ''
  local s, e = string.find(rec, '"__LOCKET_CONFLICT__"', 1, true)
  if s then
    rec = string.sub(rec, 1, s - 1) .. cjson.encode(message) .. string.sub(rec, e + 1)
  end
  redis.call('RPUSH', opt['failed_list'], rec)
  if (opt['multi_name'] or '') ~= '' then
    redis.call('SADD', opt['failed_queues'], opt['multi_name'])
  end
  incr_later(opt['stat_failed'])
  incr_later(opt['stat_failed_by'])
  acq.free_unit(a)
  redis.call('DEL', a.inflight)
  count(prefix, a.now, 'conflict_failed', a.class)
  if opt['unique'] then unique_entry.release(prefix, opt['unique'][1], a.digest, a.class) end
  a.action = 'failed'
end

-- PK-1 "park": the entry was pushed (acq.park_entry) before the record goes; nothing touches
-- the queue, its counter or stat:*. The janitor looks at the resource when its earliest
-- holder's lease ends (PK-4). RL-5: a refusal by a rate counts `rate_limited` per class.
function acq.park(a)
  local prefix, c1 = a.prefix, a.conflicts[1]
  acq.free_unit(a)
  redis.call('DEL', a.inflight)
  if a.park_len == 1 then
    local due = tonumber(c1[5]) or 0
    if c1[6] then due = now_ms() + math.max(redis.call('PTTL', c1[6]), 0) end
    if due <= 0 then due = now_ms() end
    redis.pcall('ZADD', prefix .. 'parked', 'NX', int(due), a.park_res)
  end
  if c1[1] == 'lock' then lock1_mark_parked(prefix .. 'lock:' .. c1[2]) end
  redis.pcall('HINCRBY', prefix .. 'parked_queues', a.queue, 1)
  count(prefix, a.now, 'parked', a.class)
  if c1[1] == 'rate' then count(prefix, a.now, 'rate_limited', a.class) end
  a.action = 'parked'
end

-- P-1 "requeue" (A-14): the copy is pushed to the queue's tail before the record goes (S-6:
-- if the push raises, the job stays reserved and is returned or recovered, never lost); the
-- queue's counter is bumped and each resource notes the queue it blocked.
function acq.requeue(a)
  local K, A, prefix = a.K, a.A, a.prefix
  redis.call('RPUSH', K[2], acq.job_payload(a))
  acq.free_unit(a)
  redis.call('DEL', a.inflight)
  redis.call('SADD', K[3], a.queue)
  known[K[4]] = nil
  if redis.call('INCR', K[4]) == 1 then
    redis.call('PEXPIRE', K[4], A[4])
  end
  for _, c in ipairs(a.conflicts) do
    if c[1] == 'lock' then lock1_flag(prefix .. 'lock:' .. c[2]) end
    if c[1] == 'rate' then count(prefix, a.now, 'rate_limited', a.class) end
    local bk = prefix .. 'blocked:' .. c[1] .. ':' .. c[2]
    redis.call('SADD', bk, a.queue)
    redis.call('PEXPIRE', bk, A[4])
  end
  count(prefix, a.now, 'requeued', a.class)
  a.action = 'requeued'
end

-- P-1 "discard": the job leaves, and its unique entry with it (U-2, U-3).
function acq.discard(a)
  acq.free_unit(a)
  redis.call('DEL', a.inflight)
  count(a.prefix, a.now, 'discarded', a.class)
  local u = a.opt['unique']
  if u then unique_entry.release(a.prefix, u[1], a.digest, a.class) end
  a.action = 'discarded'
end

-- P-2 "delay": the job waits in the delayed set for an exponential backoff with jitter, its
-- attempts counted per digest; past max_delays it fails instead.
function acq.delay(a)
  local prefix, opt, digest = a.prefix, a.opt, a.digest
  local d = opt['delay'] or {}
  local akey = prefix .. 'attempts'
  local attempt = redis.call('HINCRBY', akey, digest, 1)
  a.attempt = attempt
  redis.call('PEXPIRE', akey, 604800000)
  local max_delays = tonumber(d['max_delays'] or 0)
  if max_delays > 0 and attempt > max_delays then
    redis.call('HDEL', akey, digest)
    acq.fail(a, 'gave up after ' .. max_delays .. ' delays (max_delays): ' ..
      acq.conflict_text(a.conflicts[1]))
    return
  end
  local base, cap = tonumber(d['base'] or 5000), tonumber(d['max'] or 300000)
  local wait = base * math.pow(2, math.min(attempt - 1, 40))
  if wait > cap then wait = cap end
  a.now = now_ms()
  a.due = a.now + math.floor(wait * (1 + tonumber(d['r'] or 0)))
  local member = cjson.encode({rid = a.A[1], queue = a.queue, payload = acq.job_payload(a),
    reason = a.conflicts[1][1], resource = a.conflicts[1][2], attempt = attempt,
    unique = opt['unique'], digest = opt['unique'] and digest or nil})
  redis.call('ZADD', prefix .. 'delayed', a.due, member)
  acq.free_unit(a)
  redis.call('DEL', a.inflight)
  count(prefix, a.now, 'delayed', a.class)
  a.action = 'delayed'
end

-- P-3 "wait": the job keeps its reservation, marked waiting; recovery treats it like a
-- reserved one.
function acq.wait(a)
  if redis.call('HGET', a.inflight, 'state') == 'reserved' then
    redis.call('HSET', a.inflight, 'state', 'waiting')
    count(a.prefix, a.now, 'waited', a.class)
  end
end

-- A conflict settled: the locks taken are given back (L-4), the fallback's keys checked (S-6)
-- before its first write, units kept for a rate-refused job given on (RL-2), then the policy.
-- Returns {"conflict", action, due_ms, attempt, kind, id, holders, limit, earliest, ...}.
-- The server's time is read only where a rule needs it (a.now: a delay's due time, the
-- parked index's score); the counts of the job path need none.
function acq.settle(a)
  acq.undo_taken(a)
  a.now, a.action, a.due, a.attempt = nil, 'none', 0, 0
  local fallback = acq.fallback(a)
  if fallback == 'park' then fallback = acq.park_entry(a) end
  acq.check_fallback_keys(a, fallback)
  if #a.rate_conflicts > 0 then acq.give_back_units(a) end
  count(a.prefix, a.now, 'conflict', a.class)
  if a.opt['last_wait'] then count(a.prefix, a.now, 'wait_timeout', a.class) end
  acq.job_payload(a)
  if fallback == 'park' then
    acq.park(a)
  elseif fallback == 'requeue' then
    acq.requeue(a)
  elseif fallback == 'discard' then
    acq.discard(a)
  elseif fallback == 'delay' then
    acq.delay(a)
  elseif fallback == 'fail' then
    acq.fail(a, acq.conflict_text(a.conflicts[1]))
  elseif a.opt['wait'] then
    acq.wait(a)
  end
  local out = {'conflict', a.action, a.due, a.attempt}
  for _, c in ipairs(a.conflicts) do
    for j = 1, 5 do out[#out + 1] = c[j] end
  end
  return out
end
