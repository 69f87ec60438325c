-- CANCEL (locking-semantics.md A-21): asks the process that holds reservation `rid` to stop its
-- job. The request is a field of the process's cancel hash, which its worker reads once a
-- second while it runs a job (one command per process, none per job); the supervisor then
-- stops the handler as for a lost lock (A-11).
--
-- KEYS[1]  <ns>:locket:inflight:<slot key>
-- KEYS[2]  <ns>:locket:cancel:<process id>
-- ARGV[1]  rid
-- ARGV[2]  the request, JSON {"by": ..., "host": ..., "requeue": true|false}
-- ARGV[3]  how long the request is kept, in ms (a job that never reads it leaves nothing)
--
-- Returns the reservation's state ("reserved" or "running") when the request was recorded, or
-- "gone" when the slot no longer holds `rid` (the job finished): then nothing is written.
-- Raises nothing while the keys under <ns>:locket: have the types locking-semantics.md §2
-- gives them (only locketd writes there, K-1).

local rec = redis.call('HMGET', KEYS[1], 'rid', 'state')
if rec[1] ~= ARGV[1] then
  return 'gone'
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return rec[2] or 'reserved'
