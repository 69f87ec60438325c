-- FIRE one tick of a recurring schedule (scheduler-protocol.md SC-12): the enqueue and the
-- record of the schedule's last fired tick change in one atomic step, which refuses a tick
-- not later than the recorded one, so a tick is enqueued once per fleet even with two
-- schedulers racing. Then delayed:last_enqueued_at as the gem writes it.
--
-- Ticks are checked against Redis's clock (TIME): a tick later than it by more than ARGV[6]
-- seconds comes from a scheduler whose clock is ahead; it is neither enqueued nor recorded (a
-- record moved ahead would make the whole fleet skip every tick up to it). A record already
-- that far ahead (left by an older scheduler whose clock had jumped) does not count.
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
-- ARGV[6]  how many seconds a tick may be ahead of Redis's clock
--
-- Returns 1 when enqueued, 0 when the tick was fired already, -1 when the tick is ahead of
-- Redis's clock (nothing changed). Raises a LOCKET_STORE error, having changed nothing, when a
-- key another tool may write holds another type (S-6).

must_be('fire', KEYS[2], 'set')
must_be('fire', KEYS[3], 'list')
must_be('fire', KEYS[4], 'hash')
if ARGV[2] ~= '' then
  local tick = tonumber(ARGV[2])
  local limit = tonumber(redis.call('TIME')[1]) + tonumber(ARGV[6])
  if tick > limit then return -1 end
  local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '')
  if last ~= nil and last > limit then last = nil end
  if last ~= nil and last >= tick then return 0 end
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
redis.call('RPUSH', KEYS[3], ARGV[4])
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[5])
return 1
