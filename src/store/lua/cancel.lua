-- CANCEL (locking-semantics.md A-21): asks the process that holds reservation `rid` to cancel
-- its job.
-- A job that runs: the request is a field of the process's cancel hash, which its worker reads
-- once a second while it runs a job (one command per process, none per job); the supervisor
-- then stops the handler as for a lost lock (A-11).
-- A job that has not started (reserved, or waiting on its lock, P-3): the request is the
-- string `cancel_start:<rid>`, which the step that would start the job (ACQUIRE) reads in its
-- MGET and takes instead of starting it; RETURN takes it too. So no handler of a cancelled job
-- starts, whatever the timing: this script and ACQUIRE are each one atomic step.
--
-- KEYS[1]  <ns>:locket:inflight:<slot key>
-- KEYS[2]  <ns>:locket:cancel:<process id>
-- KEYS[3]  <ns>:locket:cancel_start:<rid>
-- ARGV[1]  rid
-- ARGV[2]  the request, JSON {"by": ..., "requeue": true|false}
-- ARGV[3]  how long the request is kept, in ms (a job that never reads it leaves nothing)
--
-- Returns the reservation's state ("reserved", "waiting" or "running") when the request was
-- recorded, or "gone" when the slot no longer holds `rid` (the job finished): then nothing is
-- written.
-- Raises nothing while the keys under <ns>:locket: have the types locking-semantics.md §2
-- gives them (only locketd writes there, K-1).

local rec = redis.call('HMGET', KEYS[1], 'rid', 'state')
if rec[1] ~= ARGV[1] then
  return 'gone'
end
local state = rec[2] or 'reserved'
if state == 'running' then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
else
  redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[3])
end
return state
