-- FIRE one tick of a recurring schedule (scheduler-protocol.md SC-12): the enqueue and the
-- record of the schedule's last fired tick change in one atomic step, which refuses a tick
-- not later than the recorded one, so a tick is enqueued once per fleet even with two
-- schedulers racing. Then delayed:last_enqueued_at as the gem writes it.
--
-- KEYS[1]  <ns>:locket:schedule:last   (HASH schedule name → last fired tick, Unix seconds)
-- KEYS[2]  <ns>:queues
-- KEYS[3]  <ns>:queue:<q>
-- KEYS[4]  <ns>:delayed:last_enqueued_at
-- ARGV[1]  schedule name
-- ARGV[2]  the tick (Unix seconds), or "" for `locketd schedule run` (not recorded)
-- ARGV[3]  queue name
-- ARGV[4]  the work payload
-- ARGV[5]  now as Ruby Time#to_s ("YYYY-MM-DD HH:MM:SS +0000")
--
-- Returns 1 when enqueued, 0 when the tick was fired already. Raises a LOCKET_STORE error,
-- having changed nothing, when a key another tool may write holds another type (S-6).

must_be('fire', KEYS[2], 'set')
must_be('fire', KEYS[3], 'list')
must_be('fire', KEYS[4], 'hash')
if ARGV[2] ~= '' then
  local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '')
  if last ~= nil and last >= tonumber(ARGV[2]) then return 0 end
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
redis.call('RPUSH', KEYS[3], ARGV[4])
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[5])
return 1
