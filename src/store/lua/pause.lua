-- PAUSE / RESUME (locking-semantics.md A-20): set or delete resque-pause's keys, as
-- ResquePauseHelper does (`SET <ns>:pause:queue:<q> true`, `DEL`), so that Ruby tools and
-- locketd read the same pause.
--
-- KEYS     the pause keys: <ns>:pause:queue:<q> for each queue, or <ns>:pause:all
-- ARGV[1]  "pause" or "resume"
--
-- Returns the number of keys whose state changed (set where absent, deleted where present).
-- Raises a LOCKET_STORE error, having changed nothing, when a key holds another type than a
-- string (written by hand or by another tool: S-6; it still pauses its queue, RESERVE reads
-- only whether it exists, and an operator mends it).

for _, k in ipairs(KEYS) do must_be('pause', k, 'string') end
local changed = 0
if ARGV[1] == 'pause' then
  for _, k in ipairs(KEYS) do
    if redis.call('SET', k, 'true', 'NX') then changed = changed + 1 end
  end
else
  for i = 1, #KEYS, 1000 do
    changed = changed + redis.call('DEL', unpack(KEYS, i, math.min(i + 999, #KEYS)))
  end
end
return changed
