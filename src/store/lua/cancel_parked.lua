-- CANCEL of a job that waits with no worker holding it (locking-semantics.md A-21): parked on
-- a lock, hold or rate (parked-waits.md PK-1), or delayed by the `delay` policy (P-4). The
-- operator's command found the job's exact entry by its rid while listing; this step removes
-- that entry, if it is still there, and records the job as failed with `Locket::Cancelled`
-- (the record made by the command), or with `--requeue` pushes it to the tail of its queue.
-- A parked or delayed job holds no lock, unit or cap: removing its entry releases everything
-- it has (the parked list's per-queue count and index entry follow), and a failed one its
-- unique entry, whose spec its entry carries (U-2..U-4).
--
-- KEYS[1]  the parked list <ns>:locket:parked:<resource>, or <ns>:locket:delayed
-- KEYS[2]  the failure list: <ns>:failed, or <ns>:<q>_failed (redis_multi_queue)
-- KEYS[3]  <ns>:stat:failed
-- KEYS[4]  <ns>:failed_queues
-- KEYS[5]  <ns>:queue:<q>
-- KEYS[6]  <ns>:queues
-- KEYS[7]  <ns>:locket:parked_queues
-- KEYS[8]  <ns>:locket:parked
-- ARGV[1]  "parked" or "delayed"
-- ARGV[2]  the exact entry (list element or ZSET member)
-- ARGV[3]  the Resque failure record to push, or "" to put the job back in its queue
-- ARGV[4]  the queue q
-- ARGV[5]  the resource ("lock:<id>", "dep:<name>", "rate:<key>") of a parked entry
-- ARGV[6]  "<q>_failed" to add to failed_queues (redis_multi_queue), or ""
-- ARGV[7]  the job's payload
--
-- Returns "failed" or "requeued", or "gone" when the entry is no longer there (woken,
-- promoted or cancelled meanwhile): then nothing is written. Raises a LOCKET_STORE error,
-- having changed nothing, when a key it would write holds another type (S-6).

local parked = ARGV[1] == 'parked'
if ARGV[3] ~= '' then
  must_be('cancel', KEYS[2], 'list')
  must_be('cancel', KEYS[3], 'string')
  local n = redis.call('GET', KEYS[3])
  if n and not tonumber(n) then
    error({err = 'LOCKET_STORE cancel: ' .. KEYS[3] .. ' is not a number; nothing was changed'})
  end
  if ARGV[6] ~= '' then must_be('cancel', KEYS[4], 'set') end
else
  must_be('cancel', KEYS[5], 'list')
  must_be('cancel', KEYS[6], 'set')
end
local removed
if parked then
  removed = redis.call('LREM', KEYS[1], 1, ARGV[2])
else
  removed = redis.call('ZREM', KEYS[1], ARGV[2])
end
if removed == 0 then
  return 'gone'
end
if parked then
  redis.pcall('HINCRBY', KEYS[7], ARGV[4], -1)
  if redis.call('LLEN', KEYS[1]) == 0 then redis.pcall('ZREM', KEYS[8], ARGV[5]) end
end
if ARGV[3] == '' then
  redis.call('RPUSH', KEYS[5], ARGV[7])
  redis.call('SADD', KEYS[6], ARGV[4])
  return 'requeued'
end
redis.call('RPUSH', KEYS[2], ARGV[3])
if ARGV[6] ~= '' then redis.call('SADD', KEYS[4], ARGV[6]) end
redis.call('INCR', KEYS[3])
-- U-2..U-4: a job of a unique class carries its entry's spec; failed, it holds none (put
-- back in its queue above, it keeps it).
local ok, e = pcall(cjson.decode, ARGV[2])
if ok and type(e) == 'table' and type(e['digest']) == 'string' then
  local u = e['unique']
  if type(u) == 'table' and type(u[1]) == 'string' then
    unique_entry.release(string.sub(KEYS[7], 1, -14), u[1], e['digest'], e['class'] or '')
  end
end
return 'failed'
