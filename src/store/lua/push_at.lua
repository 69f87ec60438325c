-- PUSH_AT: PUSH's delayed form (locking-semantics.md D-3b): a job scheduled as
-- resque-scheduler's `enqueue_at` schedules it (scheduler-protocol.md SC-1, SC-2), with the
-- enqueue-time holds and the `unique` key its class's published plan names placed now, at
-- schedule time, exactly as PUSH places them (push_lib.lua). The item keeps its exact bytes:
-- `remove_delayed` finds it by them, and the scheduler delivers `{"class":…,"args":…}` of it,
-- whose digest is the item's (the holds are released by the job they were placed for).
--
-- KEYS[1]  <ns>:delayed:<ts>
-- KEYS[2]  <ns>:timestamps:<item>
-- KEYS[3]  <ns>:delayed_queue_schedule
-- KEYS[4]  <ns>:locket:plans (as PUSH's KEYS[3])
-- ARGV[1]  queue name q (the item's `queue`)
-- ARGV[2]  the item, exactly as it is to be stored ({"class":…,"args":[…],"queue":"…"})
-- ARGV[3]  ts, Unix seconds (an integer)
-- ARGV[4]  locket key prefix "<ns>:locket:"
--
-- Reply: {scheduled, bucket length, hold name...}: scheduled is 1, or 0 for a duplicate the
-- class's `unique` refuses (nothing is written), then the length of `delayed:<ts>` and the
-- holds added. Writes RPUSH delayed:<ts> <item>, SADD timestamps:<item> delayed:<ts>,
-- ZADD delayed_queue_schedule <ts> <ts>, as the gem does. Errors, raised before anything is
-- written: PUSH's, and LOCKET_STORE when one of the three keys is of another type (S-6) or
-- ts is not an integer.

local ts = ARGV[3]
if not string.match(ts, '^%-?%d+$') then
  error({err = 'LOCKET_STORE push_at: the timestamp ' .. ts .. ' is not whole Unix seconds; nothing was changed'})
end
must_be('push_at', KEYS[1], 'list')
must_be('push_at', KEYS[2], 'set')
must_be('push_at', KEYS[3], 'zset')
local it = push_intent(KEYS[4], ARGV[4], ARGV[2], ARGV[1])
local reply = {1, 0}
if push_acts(it) then
  push_checks(ARGV[4], it)
  local now = now_ms()
  local digest = render_digest(it.job)
  if not push_take_unique(ARGV[4], it, digest) then
    return {0, redis.call('LLEN', KEYS[1])}
  end
  push_place_holds(ARGV[4], it, digest, now)
  for _, name in ipairs(it.holds) do reply[#reply + 1] = name end
end
reply[2] = redis.call('RPUSH', KEYS[1], ARGV[2])
redis.call('SADD', KEYS[2], 'delayed:' .. ts)
redis.call('ZADD', KEYS[3], ts, ts)
return reply
