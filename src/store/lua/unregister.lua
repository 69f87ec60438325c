-- UNREGISTER (resque-protocol.md §4 unregister_worker, checklist 16; locking-semantics.md R-8).
-- Removes one slot's Resque registration and, with the last registered slot, the process's
-- liveness. A job still in progress is not recorded here: its inflight record stays, and the
-- janitor records or requeues it by R-4, as for any dead process.
--
-- A slot that still holds a reservation (its worker could neither finish nor return it, e.g.
-- Redis failed it until the retries gave up) stays in slots:<process> and the process stays in
-- locket:processes: once no slot of the process is registered, its alive: lease is deleted, so
-- the janitor's next pass recovers the reservation (R-4) instead of it being lost (NEVER-2).
--
-- KEYS[1]  <ns>:workers
-- KEYS[2]  <ns>:worker:<resque worker id>
-- KEYS[3]  <ns>:worker:<resque worker id>:started
-- KEYS[4]  <ns>:workers:heartbeat
-- KEYS[5]  <ns>:stat:processed:<resque worker id>
-- KEYS[6]  <ns>:stat:failed:<resque worker id>
-- KEYS[7]  <ns>:locket:processes
-- KEYS[8]  <ns>:locket:slots:<process id>
-- KEYS[9]  <ns>:locket:alive:<process id>
-- KEYS[10] <ns>:locket:inflight:<process id>:<slot>
-- ARGV[1]  Resque worker id
-- ARGV[2]  process id
-- ARGV[3]  slot number
--
-- Returns "ok". Raises nothing while the keys under <ns>:locket: have
-- the types locking-semantics.md §2 gives them (only locketd writes there, K-1).

redis.call('SREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2], KEYS[3], KEYS[5], KEYS[6])
redis.call('HDEL', KEYS[4], ARGV[1])
if redis.call('EXISTS', KEYS[10]) == 0 then
  redis.call('HDEL', KEYS[8], ARGV[3])
end
local slots = redis.call('HGETALL', KEYS[8])
if #slots == 0 then
  redis.call('DEL', KEYS[8], KEYS[9])
  redis.call('SREM', KEYS[7], ARGV[2])
  return 'ok'
end
-- Slots left: registered ones (still working or stopping), or reservations left behind.
for i = 2, #slots, 2 do
  if redis.call('SISMEMBER', KEYS[1], slots[i]) == 1 then
    return 'ok'
  end
end
redis.call('DEL', KEYS[9])
return 'ok'
