-- UNREGISTER (resque-protocol.md §4 unregister_worker, checklist 16; locking-semantics.md R-8).
-- Removes one slot's Resque registration and, with the last slot, the process's liveness.
-- A failure record for a job still marked as in progress is pushed first, as Resque does.
--
-- KEYS[1]  <ns>:workers
-- KEYS[2]  <ns>:worker:<resque worker id>
-- KEYS[3]  <ns>:worker:<resque worker id>:started
-- KEYS[4]  <ns>:workers:heartbeat
-- KEYS[5]  <ns>:stat:processed:<resque worker id>
-- KEYS[6]  <ns>:stat:failed:<resque worker id>
-- KEYS[7]  <ns>:failed
-- KEYS[8]  <ns>:locket:processes
-- KEYS[9]  <ns>:locket:slots:<process id>
-- KEYS[10] <ns>:locket:alive:<process id>
-- ARGV[1]  Resque worker id
-- ARGV[2]  process id
-- ARGV[3]  slot number
-- ARGV[4]  failure record JSON to push if KEYS[2] is still set, or ""
--
-- Returns "ok". Raises nothing.

local working = redis.call('GET', KEYS[2])
if working and working ~= '' and ARGV[4] ~= '' then
  redis.call('RPUSH', KEYS[7], ARGV[4])
end
redis.call('SREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2], KEYS[3], KEYS[5], KEYS[6])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[9], ARGV[3])
if redis.call('HLEN', KEYS[9]) == 0 then
  redis.call('DEL', KEYS[9], KEYS[10])
  redis.call('SREM', KEYS[8], ARGV[2])
end
return 'ok'
