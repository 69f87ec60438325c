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
--              a ZSET with its lockinfo; lib_lock.lua). Its lockinfo:<id_i> and blocked:lock:<id_i>
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
--
-- The steps are functions of the library (lib_acquire.lua: the checks and the limit-1 locks;
-- lib_conflict.lua: the conflict policies; lib_start.lua: the success), each named for its
-- rule; this body composes them.

local a = acq.new(KEYS, ARGV)
-- One read for the lease (R-2) and the queue's counter (A-8), unless a FINISH+RESERVE or a
-- batch read them already.
if not reads_done then prefetch(acquire_reads(KEYS, ARGV)) end
local ended = acq.check_reservation(a)
if ended then return ended end
-- A-21: an operator cancelled this reservation before it started: it does not start. The
-- request is taken (its key deleted, this step's only write) and handed to the worker, which
-- records the job as cancelled (or puts it back with `--requeue`) by FINISH; nothing of the
-- job ran, no lock was taken.
local cancelled = take_cancel_start(a.prefix, ARGV[1])
if cancelled then
  return {'cancelled', cancelled}
end
-- The plain case: no options, every lock of limit 1 and free.
if ARGV[12] == '' and acq.plain(a) then
  return {'ok', a.wnow + a.ttl}
end

-- The full path: the rates are read before any write (RL-1, RL-2), then the locks of a
-- larger limit are purged and counted (L-4), the locked_by names checked (D-5), and the
-- limit-1 locks taken while nothing conflicts.
acq.options(a)
acq.check_rates(a)
acq.check_larger_locks(a)
acq.check_locked_by(a)
for _, c in ipairs(a.rate_conflicts) do a.conflicts[#a.conflicts + 1] = c end
acq.take_limit1_locks(a)
if #a.conflicts > 0 then
  return acq.settle(a)
end

-- RL-1: the start counts against every rate of the job, one SET per rate (a ZSET's three or
-- four commands above RATE_STRING_MAX, rate.lua), first of the success's writes: a string
-- log that holds another type (MGET read it as nil, and its SET NX refuses) undoes them and
-- the locks taken above, and raises (S-6).
if #a.rates > 0 then
  rate_record(a.prefix, a.rates, a.rate_logs, now_ms(), 'acquire',
    function() acq.undo_taken(a) end, ARGV[1])
end
-- A-7a: TAKE sends no digest. A start on limit-1 locks records none (`locketd locks` works it
-- out from the slot's record), nor does a park (its unit is keyed by the payload's SHA1,
-- PK-3); a job that holds a lock of a larger limit has it in that lock's lockinfo.
if ARGV[11] == '' and acq.digest_later and acq.holds_larger(a) then
  ARGV[11] = acq.digest_of(a)
  a.info_inner = a.info_inner .. ',"digest":"' .. a.digest .. '"'
  a.info_sep = ','
end
local ids, out, fence_list = acq.hold_locks(a)
local holds, now = acq.add_holds(a)
acq.start_job(a, ids, holds, fence_list, now)
acq.after_start(a)
return out
