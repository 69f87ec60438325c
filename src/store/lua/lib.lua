-- Shared helpers, prepended to every locket script by src/store/scripts.rs.
-- Nothing here touches a key on its own; the functions act on the keys they are given.

-- (scripts.rs puts REPLICATE, for Redis 5, before this in every EVAL script.)

-- S-6: a step checks, before its first write, every key another tool may have written that it
-- is about to write (a queue, the `queues` set, a failure list, `failed_queues`): one whose
-- type is not `want` stops the step with a LOCKET_STORE error that names the step and the key,
-- and nothing has been written. Redis does not roll a script back, so a WRONGTYPE raised by a
-- later push would leave the step half-applied. (Keys under <ns>:locket: are written by
-- locketd only, K-1, and their type is not checked.)
local function must_be(step, key, want)
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= want then
    error({err = 'LOCKET_STORE ' .. step .. ': WRONGTYPE ' .. key .. ' holds a ' .. t .. ', not a ' ..
      want .. '; nothing was changed'})
  end
end

-- Parked waits (PK-*): defined in lib_park.lua (appended to this file), named here so that
-- the release helpers below can wake the jobs parked on what they free.
local parked_wake, lock1_handoff, lockn_handoff, parked_wake_freed

-- HDEL of every field in `fields`, 1,000 at a time: `unpack()` of a long list raises ("too
-- many results to unpack") past Lua's stack limit of about 8,000 values.
local function hdel_all(key, fields)
  for i = 1, #fields, 1000 do
    redis.call('HDEL', key, unpack(fields, i, math.min(i + 999, #fields)))
  end
end

-- t[i..j] as a new list: unpack() into a table constructor for the usual short lists, a loop
-- past unpack's stack limit (a RESERVE over thousands of queues).
local function slice(t, i, j)
  if j - i < 4000 then return {unpack(t, i, j)} end
  local out = {}
  for x = i, j do out[#out + 1] = t[x] end
  return out
end

-- Redis server time in milliseconds (S-2: no worker clock is ever used for deadlines), read
-- once per run: a script, or a batch of them (batch.lua), runs as one atomic step.
local cached_now = nil
local function now_ms()
  if cached_now == nil then
    local t = redis.call('TIME')
    cached_now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return cached_now
end

-- String values this run has read or written (key -> value, or false for absent / not a
-- string), so that a step reads each at most once and a batch of steps reads them together:
-- prefetch() gets every key a step will read in one MGET before it starts (the pause flag,
-- the process lease, the queues' lock counters, the job's limit-1 locks). MGET answers nil
-- for a key of another type, so a value another tool wrote cannot make a step raise. Every
-- write of such a key here updates the entry (a batch is one atomic step: nothing else writes
-- meanwhile).
local known = {}
local function prefetch(keys)
  local want = {}
  for _, k in ipairs(keys) do
    if known[k] == nil then
      want[#want + 1] = k
      known[k] = false
    end
  end
  for i = 1, #want, 1000 do
    local last = math.min(i + 999, #want)
    local vals = redis.call('MGET', unpack(want, i, last))
    for j = i, last do known[want[j]] = vals[j - i + 1] or false end
  end
end
-- Set once a FINISH+RESERVE or a batch has prefetched what all its parts read: the parts then
-- skip building their lists of keys again.
local reads_done = false
-- The string value of `key`, or false.
local function sget(key)
  local v = known[key]
  if v == nil then
    v = redis.call('MGET', key)[1] or false
    known[key] = v
  end
  return v
end

-- "<prefix>alive:<process id>" of the slot record `inflight` ("<prefix>inflight:<process
-- id>:<n>"), or nil for a record name without a process.
-- Each record's lease key is worked out once and kept across runs (reset_run's memos).
local lease_keys = {}
local function lease_key(prefix, inflight)
  local k = lease_keys[inflight]
  if k == nil then
    local process = string.match(string.sub(inflight, #prefix + 10), '^(.*):%d+$')
    k = process ~= nil and (prefix .. 'alive:' .. process)
    lease_keys[inflight] = k
  end
  return k or nil
end

-- R-2, A-1, A-6: whether the process owning the slot record `inflight` still holds its lease.
-- A process whose lease is gone may have been recovered already: it must not reserve or
-- start anything, since nothing would recover what it took. While the lease is held, nothing
-- but the process itself writes its slot records (recovery needs the lease gone, R-4, and
-- HEARTBEAT only extends a lease that exists, never recreates it).
-- Whether the slot record `inflight` can be trusted to be this process's own without reading
-- it: the lease is held (lease_held). A record name without a process (no lease to check)
-- is read.
local function lease_trusted(prefix, inflight)
  local k = lease_key(prefix, inflight)
  return k ~= nil and sget(k) ~= false
end

-- A-21: `<prefix>cancel_start:<rid>`, an operator's cancel of reservation `rid` before it
-- starts (cancel.lua writes it; ACQUIRE and RETURN take it instead of starting or returning
-- the job). A string, read in the step's MGET: a job path without cancels pays no command.
local function cancel_start_key(prefix, rid)
  return prefix .. 'cancel_start:' .. rid
end

-- A-21: the cancel request for reservation `rid` that has not started, or false. Taking it
-- deletes the key, so that exactly one step acts on it.
local function take_cancel_start(prefix, rid)
  local k = cancel_start_key(prefix, rid)
  local v = sget(k)
  if v then
    redis.call('DEL', k)
    known[k] = false
  end
  return v
end

local function lease_held(prefix, inflight)
  local k = lease_key(prefix, inflight)
  if k == nil then return true end
  return sget(k) ~= false
end

-- Inflight records deleted by FINISH in this run (a RESERVE of the same slot in the same run
-- needs no K-2 check; its HSET forgets it).
local inflight_freed = {}

-- Deletes a lock counter unless this run knows it is absent.
local function clear_counter(key)
  if known[key] ~= false then
    redis.call('DEL', key)
    known[key] = false
  end
end

-- A whole number as decimal text for redis.call. Redis formats a Lua number argument with
-- "%.17g", which costs glibc's multi-precision float printing; "%d" is plain integer printing.
local function int(n)
  return string.format('%d', n)
end

-- A-14: a resource lost a holder, so the queues whose jobs were requeued because of it
-- may run again: delete their counters and the blocked set.
local function reset_blocked(blocked_key, counter_prefix)
  local queues = redis.call('SMEMBERS', blocked_key)
  for _, q in ipairs(queues) do
    clear_counter(counter_prefix .. q)
  end
  if #queues > 0 then
    redis.call('DEL', blocked_key)
  end
  return #queues
end

-- L-1/A-6 step 2: drop holders whose deadline is not later than now, with their lockinfo
-- fields, and run A-14 when any were dropped. Returns the number removed, and whether the lock
-- has no holder left. The earliest holder alone tells the common cases in one call: no key (or
-- an empty one), or nothing expired.
local function purge_expired(lock_key, info_key, blocked_key, now, counter_prefix)
  -- The common case, a free lock that blocked no queue, costs one call.
  if redis.call('EXISTS', lock_key, blocked_key) == 0 then
    return 0, true
  end
  -- L-1b: a limit-1 holder's STRING (a handoff made the lock one) has no member to purge.
  local first = redis.pcall('ZRANGE', lock_key, 0, 0, 'WITHSCORES')
  if first.err then return 0, false end
  if #first == 0 then
    -- A key that lapsed on its own (L-6) lost its holders by expiry too: A-14 still applies.
    reset_blocked(blocked_key, counter_prefix)
    return 0, true
  end
  if tonumber(first[2]) > now then
    return 0, false
  end
  local expired = redis.call('ZRANGEBYSCORE', lock_key, '-inf', int(now))
  redis.call('ZREMRANGEBYSCORE', lock_key, '-inf', int(now))
  hdel_all(info_key, expired)
  reset_blocked(blocked_key, counter_prefix)
  -- PK-2: an expiry purge frees units; as many parked jobs wake.
  parked_wake_freed(lock_key, counter_prefix, #expired)
  return #expired, false
end

-- L-6/L-7: after any change, expire the lock keys 1 s after the latest deadline and score the
-- `locks` index with the earliest one; an empty lock disappears from both.
-- A lock that a handoff made a limit-1 holder's STRING (L-1b) leaves the index, which lists
-- the larger locks only.
local function fix_lock(lock_key, info_key, locks_index, lock_id)
  local first = redis.pcall('ZRANGE', lock_key, 0, 0, 'WITHSCORES')
  if first.err then
    redis.call('ZREM', locks_index, lock_id)
    return
  end
  if #first == 0 then
    redis.call('DEL', lock_key, info_key)
    redis.call('ZREM', locks_index, lock_id)
    return
  end
  local last = redis.call('ZRANGE', lock_key, -1, -1, 'WITHSCORES')
  local expire_at = int(tonumber(last[2]) + 1000)
  redis.call('PEXPIREAT', lock_key, expire_at)
  if redis.call('EXISTS', info_key) == 1 then
    redis.call('PEXPIREAT', info_key, expire_at)
  end
  redis.call('ZADD', locks_index, first[2], lock_id)
end

-- fix_lock for a lock whose only holder (with its lockinfo field) has just been added with
-- `deadline`: the earliest and latest deadlines are that one, known without reading them.
local function fix_sole_holder(lock_key, info_key, locks_index, lock_id, deadline)
  local expire_at = int(deadline + 1000)
  redis.call('PEXPIREAT', lock_key, expire_at)
  redis.call('PEXPIREAT', info_key, expire_at)
  redis.call('ZADD', locks_index, int(deadline), lock_id)
end

-- L-5: compare-and-delete of one holder. Releasing a token that is not a member changes
-- nothing but the A-14 reset.
local function release_token(lock_key, info_key, blocked_key, locks_index, lock_id, token, counter_prefix)
  local removed = redis.call('ZREM', lock_key, token)
  local p = string.sub(counter_prefix, 1, #counter_prefix - 8)
  local parked_key = p .. 'parked:lock:' .. lock_id
  -- The common case, the last holder leaving a lock that blocked no queue and has no job
  -- parked on it: one EXISTS tells.
  if redis.call('EXISTS', lock_key, blocked_key, parked_key) == 0 then
    redis.call('DEL', info_key)
    redis.call('ZREM', locks_index, lock_id)
    return removed
  end
  reset_blocked(blocked_key, counter_prefix)
  if redis.call('EXISTS', lock_key) == 0 then
    -- The last holder left: both keys and the index entry go (no per-field delete needed).
    redis.call('DEL', info_key)
    redis.call('ZREM', locks_index, lock_id)
  else
    redis.call('HDEL', info_key, token)
    fix_lock(lock_key, info_key, locks_index, lock_id)
  end
  -- PK-2: the unit freed wakes one parked job.
  parked_wake_freed(lock_key, counter_prefix, removed)
  return removed
end

-- L-1 with limit 1, the common lock: a STRING key lock:<id>, taken with `SET NX PX` (the
-- check, the take and the lease's expiry in one call) and released by compare-and-delete. Its
-- value is the holder's info, a JSON object that starts with a flag and the token:
-- {"blocked":0,"token":"<token>",...}. The flag turns 1 when a conflict requeue named a
-- queue in blocked:lock:<id> while this holder held it, so that the release knows from the
-- value it read whether A-14 has anything to reset. A lock of a larger limit is a ZSET with
-- `lockinfo` and the `locks` index (fix_lock above). A key of the other kind counts as full
-- (a class whose limit changed while its old holders run never gets more holders), except for
-- the job a unit of it was handed to (L-1b, acquire.lua).
local LOCK1_HEAD = '{"blocked":0,"token":"'
local function lock1_holds(v, token)
  return v and string.sub(v, 23, 22 + #token) == token and
    string.sub(v, 23 + #token, 23 + #token) == '"'
end
-- The flag is a digit of two bits: 1, a requeue named a queue in blocked:lock:<id> (A-14);
-- 2, jobs are parked on the lock (PK-2): 0 neither, 3 both.
local function lock1_flagged(v)
  if not v then return false end
  local c = string.sub(v, 12, 12)
  return c == '1' or c == '3'
end
local function lock1_parked(v)
  if not v then return false end
  local c = string.sub(v, 12, 12)
  return c == '2' or c == '3'
end
-- Sets bit `bit` (1 or 2) of a limit-1 holder's flag (the expiry is kept).
local function lock1_set_bit(lk, bit)
  local v = sget(lk)
  if not v or string.sub(v, 1, 11) ~= '{"blocked":' then return end
  local c = tonumber(string.sub(v, 12, 12)) or 0
  if math.floor(c / bit) % 2 == 1 then return end
  local nv = '{"blocked":' .. int(c + bit) .. string.sub(v, 13)
  redis.call('SET', lk, nv, 'KEEPTTL')
  known[lk] = nv
end
-- A-14 for a conflict on a limit-1 lock: flag its holder.
local function lock1_flag(lk)
  lock1_set_bit(lk, 1)
end
-- PK-1 for a park on a limit-1 lock: flag its holder, so that its release wakes (PK-2).
local function lock1_mark_parked(lk)
  lock1_set_bit(lk, 2)
end
-- L-5 for a limit-1 lock: compare-and-delete, and A-14 when the holder was flagged. The key is
-- appended to `dels` when given (the caller deletes it with its own keys, in one DEL, before
-- anything else in the run touches it), else deleted here. `bk`, the lock's blocked set, is
-- named from `lk` when nil ("<prefix>lock:<id>" -> "<prefix>blocked:lock:<id>"). Returns 1 when
-- released.
-- A holder flagged as parked on (PK-2) hands the lock to the first parked job instead
-- (lock1_handoff): the key is then rewritten, not deleted.
local function lock1_release(lk, bk, token, counter_prefix, dels)
  local v = sget(lk)
  if not lock1_holds(v, token) then return 0 end
  local handed = false
  if lock1_parked(v) then
    local p = string.sub(counter_prefix, 1, #counter_prefix - 8)
    handed = lock1_handoff(p, lk, string.sub(lk, #p + 6))
  end
  if not handed then
    if dels then dels[#dels + 1] = lk else redis.call('DEL', lk) end
    known[lk] = false
  end
  if lock1_flagged(v) then
    if bk == nil then
      local p = string.sub(counter_prefix, 1, #counter_prefix - 8)
      bk = p .. 'blocked:' .. string.sub(lk, #p + 1)
    end
    reset_blocked(bk, counter_prefix)
  end
  return 1
end
-- L-5 for a lock of either kind (recovery and admin releases do not know the limit).
local function release_any(lk, ik, bk, index, id, token, counter_prefix)
  if sget(lk) then return lock1_release(lk, bk, token, counter_prefix, nil) end
  return release_token(lk, ik, bk, index, id, token, counter_prefix)
end

local function is_true(v)
  return v and string.lower((string.gsub(v, '^%s*(.-)%s*$', '%1'))) == 'true'
end

-- Epoch seconds as Ruby's Time#iso8601 in UTC, "2026-11-21T12:18:29+00:00": the form Resque
-- writes into workers:heartbeat (from the Redis clock, resque-protocol.md §4).
local function iso8601(secs)
  local days = math.floor(secs / 86400)
  local rem = secs - days * 86400
  -- civil-from-days (proleptic Gregorian), days since 1970-01-01
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local y = yoe + era * 400
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp + 3
  if m > 12 then m = m - 12 end
  if m <= 2 then y = y + 1 end
  return string.format('%04d-%02d-%02dT%02d:%02d:%02d+00:00', y, m, d,
    math.floor(rem / 3600), math.floor((rem % 3600) / 60), rem % 60)
end

-- t[k], a table, made empty the first time it is asked for (the memos' nested tables).
local function child(t, k)
  local c = t[k]
  if c == nil then
    c = {}
    t[k] = c
  end
  return c
end
-- Empties table t in place (a table kept and emptied costs less than one made anew).
local function clear(t)
  for k in pairs(t) do t[k] = nil end
end

-- O-3: count an event (`<event>`, and `<event>|<class>` when a class is given). Counts are
-- summed in Lua. The job-path steps (RESERVE, ACQUIRE, FINISH and their batches) hand them to
-- the worker with their reply (`counts_reply`, set by src/store/scripts.rs): the worker adds
-- them up in memory and writes stat:<event> and the metrics:<epoch minute> bucket at most once
-- per second (src/store/tally.rs), so they cost the job path nothing. The other steps (janitor,
-- admin, scheduler: seconds apart) write theirs at their end, in flush_counts().
local counts, counts_prefix, counts_bucket = {}, nil, nil
local counts_reply = false
-- "<event>|<class>" field names, made once and kept across runs: event -> class -> field.
local class_fields = {}
-- A counted field's entry in the joined reply when its count is 1 (flush_counts), made once and
-- kept across runs: field -> entry.
local one_entries = {}
local function count(prefix, now, event, class, n)
  n = n or 1
  if n == 0 then return end
  if counts_prefix == nil then
    counts_prefix = prefix
    if not counts_reply then
      counts_bucket = prefix .. 'metrics:' .. int(math.floor((now or now_ms()) / 60000))
    end
  end
  counts[event] = (counts[event] or 0) + n
  if class and class ~= '' then
    local fields = child(class_fields, event)
    local f = fields[class]
    if f == nil then
      f = event .. '|' .. class
      fields[class] = f
    end
    counts[f] = (counts[f] or 0) + n
  end
end

-- A-1: `payload`, popped from `queue`, becomes the reservation in slot record `inflight`
-- (RESERVE's write: reserve.lua, and FINISH+RESERVE's short path).
local function record_reservation(inflight, prefix, rid, worker, queue, payload, now)
  redis.call('HSET', inflight,
    'rid', rid,
    'queue', queue,
    'payload', payload,
    'reserved_at', int(now),
    'state', 'reserved',
    'resque_worker', worker)
  inflight_freed[inflight] = nil
  count(prefix, now, 'reserved', '')
end

-- Resque's own counters (stat:processed and the like) are summed the same way and always
-- written in the step (they stay exact, per job): a batch of FINISHes writes stat:processed once.
local incrs = {}
local function incr_later(key, n)
  incrs[key] = (incrs[key] or 0) + (n or 1)
end

-- Writes the Resque counters summed by incr_later() and, unless counts_reply is set, the
-- counts summed by count(); returns the counts when it is set, as one string of entries
-- `<n>,<length of field>:<field>` (src/store/tally.rs reads it): one bulk string costs
-- Redis and the worker's parser far less than a reply element per field and per number.
-- The bucket gets its 8 h expiry when one of its event fields is created (event names hold no
-- '|'; the class fields do).
-- RL-5: the per-class counts that /metrics reads fleet-wide from `<prefix>rate_stats` as
-- well (src/store/tally.rs keeps the same list).
local function is_rate_stat(field)
  return string.sub(field, 1, 13) == 'rate_limited|' or string.sub(field, 1, 10) == 'throttled|'
end

local function flush_counts()
  -- Counts are observability: a counter key another tool made a non-integer or another type
  -- is passed over (redis.pcall), so it never fails the step whose writes are already made.
  for key, n in pairs(incrs) do
    redis.pcall('INCRBY', key, int(n))
  end
  clear(incrs)
  if counts_reply then
    local parts, i = {}, 0
    for field, n in pairs(counts) do
      i = i + 1
      local e
      if n == 1 then
        e = one_entries[field]
        if e == nil then
          e = '1,' .. #field .. ':' .. field
          one_entries[field] = e
        end
      else
        e = int(n) .. ',' .. #field .. ':' .. field
      end
      parts[i] = e
    end
    clear(counts)
    counts_prefix = nil
    return table.concat(parts)
  end
  if counts_prefix == nil then return end
  local m = counts_bucket
  local fresh = false
  for field, n in pairs(counts) do
    local s = int(n)
    if string.find(field, '|', 1, true) then
      redis.pcall('HINCRBY', m, field, s)
      if is_rate_stat(field) then redis.pcall('HINCRBY', counts_prefix .. 'rate_stats', field, s) end
    else
      redis.pcall('INCRBY', counts_prefix .. 'stat:' .. field, s)
      if redis.pcall('HINCRBY', m, field, s) == n then fresh = true end
    end
  end
  if fresh then redis.pcall('PEXPIRE', m, '28800000') end
  clear(counts)
  counts_prefix, counts_bucket = nil, nil
end

-- "<ns>:locket:" from the counter prefix "<ns>:locket:counter:" the scripts already receive.
local locket_prefixes = {}
local function locket_prefix(counter_prefix)
  local p = locket_prefixes[counter_prefix]
  if p == nil then
    p = string.sub(counter_prefix, 1, #counter_prefix - 8)
    locket_prefixes[counter_prefix] = p
  end
  return p
end

-- "<prefix>counter:<queue>", made once per queue and kept across runs (every RESERVE names
-- the same queues call after call).
local counter_keys = {}
local function counter_key(prefix, q)
  local by_q = child(counter_keys, prefix)
  local k = by_q[q]
  if k == nil then
    k = prefix .. 'counter:' .. q
    by_q[q] = k
  end
  return k
end

-- The keys RESERVE names from queue q: {queue key, counter, cap (A-22), pause key (A-20)},
-- made once per queue and kept across runs; [1] of a prefix's table is its "<ns>:pause:all".
-- `prefix` is "<ns>:locket:", `queue_prefix` "<ns>:queue:".
local queue_key_sets = {}
local function queue_keys(prefix, queue_prefix, q)
  local by_prefix = child(queue_key_sets, prefix)
  local sets = by_prefix[queue_prefix]
  if sets == nil then
    sets = {string.sub(queue_prefix, 1, -7) .. 'pause:all'}
    by_prefix[queue_prefix] = sets
  end
  local ks = sets[q]
  if ks == nil then
    ks = {queue_prefix .. q, counter_key(prefix, q), prefix .. 'cap:' .. q,
      string.sub(queue_prefix, 1, -7) .. 'pause:queue:' .. q}
    sets[q] = ks
  end
  return ks, sets[1]
end

-- Operator controls of a queue, read by RESERVE in its own step (issue 27): resque-pause's
-- keys <ns>:pause:queue:<q> and <ns>:pause:all (A-20) and the fleet-wide cap
-- <ns>:locket:cap:<q> (A-22). A pause key that exists pauses, whatever it holds (resque-pause
-- reads "not nil"; one of another type, written by hand, pauses too and is never overwritten:
-- `locketd pause` refuses it). A cap key holds a whole number; one of another type, or a
-- string that is not a number, refuses its queue (nothing is popped from it, the worker
-- reports it) instead of reading as "no cap" (S-6).
--
-- One EXISTS over all these keys, and over the slot record `inflight` when given (the K-2
-- check of a RESERVE not fused with its slot's FINISH), settles the common case: it counts 0,
-- or exactly the string keys this run's MGET read already (reserve_reads reads the pause and
-- cap keys of up to 16 queues), so the slot is free and those values are all there is.
-- Otherwise the record gets an EXISTS of its own, the keys not read yet one MGET, and only
-- when a key exists that MGET cannot read (another type), the unread ones an EXISTS each.
-- `trust` (the worker looked at these keys' types less than a second ago, A-20): with no
-- record to check and every key read by this run's MGET, that MGET is taken as the whole
-- answer and the EXISTS is left out, so a key of another type is seen within a second, by
-- the worker's next look, instead of at once. Strings (what every tool writes) are read at once
-- either way.
-- Returns true when the record exists (nothing else is worked out), else false and
-- {paused = false or a set of paused queue names, caps = queue -> cap, refused = set of
-- queue names whose cap key is unreadable, odd = whether a key of another type was found}.
-- The keys' part is kept for the run (a batch's RESERVEs name the same queues; no job-path
-- step writes these keys).
-- `prefix` is "<ns>:locket:", `queue_prefix` "<ns>:queue:"; `A[first..last]` the queue names.
local guards_of = {}
local function queue_guards(prefix, queue_prefix, A, first, last, inflight, trust)
  local id = prefix .. '\n' .. table.concat(A, '\n', first, last)
  local g = guards_of[id]
  if g ~= nil then
    if inflight and redis.call('EXISTS', inflight) == 1 then return true, nil end
    return false, g
  end
  local pause_prefix = string.sub(queue_prefix, 1, -7) .. 'pause:'
  local keys = {pause_prefix .. 'all'}
  for i = first, last do keys[#keys + 1] = pause_prefix .. 'queue:' .. A[i] end
  for i = first, last do keys[#keys + 1] = prefix .. 'cap:' .. A[i] end
  local ek = keys
  if inflight then
    ek = {inflight}
    for _, k in ipairs(keys) do ek[#ek + 1] = k end
  end
  -- The string keys this run's MGET read already, and whether it read them all.
  local strings, all_read = 0, true
  for _, k in ipairs(keys) do
    if known[k] == nil then all_read = false elseif known[k] then strings = strings + 1 end
  end
  local trusted = trust and not inflight and all_read
  local total = strings
  if not trusted then
    total = 0
    for i = 1, #ek, 1000 do
      total = total + redis.call('EXISTS', unpack(ek, i, math.min(i + 999, #ek)))
    end
  end
  g = {paused = false, caps = {}, refused = {}, odd = false}
  if total > 0 then
    -- Keys that exist but hold another type than a string.
    local other = {}
    if not (all_read and total == strings) then
      if inflight and redis.call('EXISTS', inflight) == 1 then return true, nil end
      -- The record is absent: `total` counts the keys alone.
      prefetch(keys)
      strings = 0
      for _, k in ipairs(keys) do
        if known[k] then strings = strings + 1 end
      end
      if total > strings then
        g.odd = true
        for j, k in ipairs(keys) do
          if not known[k] and redis.call('EXISTS', k) == 1 then other[j] = true end
        end
      end
    end
    local n = last - first + 1
    local paused, any = {}, false
    for i = first, last do
      local q, j = A[i], i - first + 1
      local pj, cj = 1 + j, 1 + n + j
      if known[keys[1]] or other[1] or known[keys[pj]] or other[pj] then
        paused[q] = true
        any = true
      end
      if other[cj] then
        g.refused[q] = true
      elseif known[keys[cj]] then
        local cap = tonumber(known[keys[cj]])
        if cap then g.caps[q] = cap else g.refused[q] = true end
      end
    end
    if any then g.paused = paused end
  end
  -- A look that trusted the MGET is not kept: a later RESERVE of the run (a batch's) may be
  -- the one that looks at the types.
  if not trusted then guards_of[id] = g end
  return false, g
end

-- The string keys each job-path step reads, gathered so that a FINISH+RESERVE, or a batch
-- of steps, reads all of them in one MGET (prefetch). The layouts are the scripts' own.
-- RESERVE: the pause flag, the lease, and, when there are at most 16 queues, the queues'
-- counters, caps (A-22) and pause keys (A-20) (with more, most are empty, and RESERVE reads
-- the counter of a queue only once an EXISTS over its run of queues found a job, and the caps
-- and pause keys only once queue_guards found some).
local function reserve_reads(K, A)
  local out = {K[2]}
  out[#out + 1] = lease_key(A[4], K[1])
  if #A - 6 <= 16 then
    local pause_prefix = string.sub(A[5], 1, -7) .. 'pause:'
    out[#out + 1] = pause_prefix .. 'all'
    for i = 1, #A - 6 do
      out[#out + 1] = counter_key(A[4], A[6 + i])
      out[#out + 1] = A[4] .. 'cap:' .. A[6 + i]
      out[#out + 1] = pause_prefix .. 'queue:' .. A[6 + i]
    end
  end
  return out
end
-- FINISH: the lease and the job's limit-1 locks.
local function finish_reads(K, A)
  local out = {}
  out[#out + 1] = lease_key(locket_prefix(A[6]), K[1])
  -- A-22: the queue's cap, if any (its unit is freed).
  out[#out + 1] = locket_prefix(A[6]) .. 'cap:' .. A[7]
  for i = 1, (#A - 12) / 2 do
    if (tonumber(A[12 + 2 * i]) or 1) <= 1 then out[#out + 1] = K[11 + i] end
  end
  return out
end
-- ACQUIRE: the lease, the queue's counter and cap (A-22: a conflict frees its unit) and the
-- job's limit-1 locks.
local function acquire_reads(K, A)
  local out = {}
  out[#out + 1] = lease_key(locket_prefix(A[8]), K[1])
  out[#out + 1] = cancel_start_key(locket_prefix(A[8]), A[1])
  out[#out + 1] = K[4]
  out[#out + 1] = locket_prefix(A[8]) .. 'cap:' .. A[9]
  for i = 1, (#A - 14) / 2 do
    if (tonumber(A[14 + 2 * i]) or 1) <= 1 then out[#out + 1] = K[6 + i] end
  end
  -- RL-1, RL-4: the rates' logs (rate.lua), with their closes.
  if string.find(A[12], '"rates":', 1, true) then
    local ok, o = pcall(cjson.decode, A[12])
    if ok and type(o) == 'table' and type(o['rates']) == 'table' then
      for _, r in ipairs(o['rates']) do
        out[#out + 1] = locket_prefix(A[8]) .. 'ratelog:' .. tostring(r[1])
      end
    end
  end
  return out
end

-- FINISH+RESERVE's KEYS and ARGV cut into each part's (finish_reserve.lua gives the layout),
-- once per call: a batch cuts them for its MGET and the call uses the same parts.
local splits = {}
local function split_finish_reserve(K, A)
  local s = splits[K]
  if s == nil then
    local nk, na = tonumber(A[1]), tonumber(A[2])
    s = {slice(K, 1, nk), slice(A, 3, 2 + na), slice(K, nk + 1, #K), slice(A, 3 + na, #A)}
    splits[K] = s
  end
  return s[1], s[2], s[3], s[4]
end
local function finish_reserve_reads(K, A)
  local fk, fa, rk, ra = split_finish_reserve(K, A)
  local reads = finish_reads(fk, fa)
  for _, k in ipairs(reserve_reads(rk, ra)) do reads[#reads + 1] = k end
  return reads
end

-- D-1: a hold field is "<count>:<deadline ms>".
local function dep_field(v)
  local c, d = string.match(v or '', '^(%d+):(%d+)$')
  return tonumber(c) or 0, tonumber(d) or 0
end

-- D-1, D-2, D-6, A-14: drop the expired fields of hold `name`, then set the key's expiry to the
-- latest field deadline and its `deps` score to the earliest; a name without fields is deleted,
-- leaves the index and resets the counters of the queues it blocked.
-- Returns the live total, a table digest -> count, and the number of fields dropped.
local function dep_state(prefix, name, now)
  local key = prefix .. 'dep:' .. name
  local all = redis.call('HGETALL', key)
  local total, counts, dropped, earliest, latest = 0, {}, {}, nil, nil
  for i = 1, #all, 2 do
    local c, d = dep_field(all[i + 1])
    if c <= 0 or d <= now then
      dropped[#dropped + 1] = all[i]
    else
      total = total + c
      counts[all[i]] = c
      if earliest == nil or d < earliest then earliest = d end
      if latest == nil or d > latest then latest = d end
    end
  end
  if #dropped > 0 then
    hdel_all(key, dropped)
  end
  if total == 0 then
    if #all > 0 then redis.call('DEL', key) end
    redis.call('ZREM', prefix .. 'deps', name)
    reset_blocked(prefix .. 'blocked:dep:' .. name, prefix .. 'counter:')
    -- PK-2, PK-7: a released hold wakes every job parked on it, 1,000 a call; the janitor
    -- moves the rest (the index entry is due now).
    if redis.call('EXISTS', prefix .. 'parked:dep:' .. name) == 1 then
      local _, left = parked_wake(prefix, 'dep:' .. name, 1000)
      if left > 0 then redis.pcall('ZADD', prefix .. 'parked', 'XX', int(now), 'dep:' .. name) end
    end
  else
    redis.call('PEXPIREAT', key, latest)
    redis.call('ZADD', prefix .. 'deps', earliest, name)
  end
  return total, counts, #dropped
end

-- D-2: one more hold of `name` by `digest`, living at least `ttl` ms from now.
local function hold_add(prefix, name, digest, ttl, now)
  local key = prefix .. 'dep:' .. name
  local c, d = dep_field(redis.call('HGET', key, digest))
  if d <= now then c = 0; d = 0 end
  local deadline = math.max(d, now + ttl)
  redis.call('HSET', key, digest, (c + 1) .. ':' .. deadline)
  dep_state(prefix, name, now)
end

-- D-6: one hold of `name` by `digest` fewer; never another digest's, never below zero.
-- Returns 1 when a hold was released.
local function hold_release(prefix, name, digest, now)
  local key = prefix .. 'dep:' .. name
  local v = redis.call('HGET', key, digest)
  if not v then return 0 end
  local c, d = dep_field(v)
  local released = 0
  if d > now and c > 0 then released = 1 end
  if c <= 1 or d <= now then
    redis.call('HDEL', key, digest)
  else
    redis.call('HSET', key, digest, (c - 1) .. ':' .. d)
  end
  dep_state(prefix, name, now)
  return released
end

-- Every per-run value above back to its start. A script's chunk runs anew for each EVALSHA,
-- so there this changes nothing; a FUNCTION library's locals live as long as the library, so
-- each of its functions calls this first (src/store/scripts.rs). Every local above that a run
-- writes is listed here.
-- Per-run tables are emptied, not made anew (a table made and grown key by key each run, and
-- its garbage, cost about 2% of a job's FCALL instructions: docs/dev/performance-log.md).
-- The memos of pure functions of their arguments (lease keys, locket prefixes, counter keys,
-- queue key sets, "<event>|<class>" fields) are kept from run to run, made anew every
-- MEMO_RUNS runs (a run adds a bounded number of entries, so this bounds them).
local MEMO_RUNS = 4096
local runs_since_memo_reset = 0
local function reset_run()
  cached_now = nil
  clear(known)
  reads_done = false
  clear(inflight_freed)
  clear(counts)
  counts_prefix, counts_bucket = nil, nil
  counts_reply = false
  clear(incrs)
  clear(splits)
  clear(guards_of)
  runs_since_memo_reset = runs_since_memo_reset + 1
  if runs_since_memo_reset > MEMO_RUNS then
    runs_since_memo_reset = 0
    lease_keys, class_fields, locket_prefixes, counter_keys = {}, {}, {}, {}
    one_entries, queue_key_sets = {}, {}
  end
end
