-- PUSH a job the way Resque pushes it, with the enqueue-time holds (`when = "enqueue"`) that
-- its class's published plan names, rendered here from the exact payload bytes (locking-
-- semantics.md D-3, D-3a; render.lua, push_lib.lua). The one enqueue path: `locketd enqueue`,
-- the Rust client, and any client that can send FCALL (or EVALSHA of the same script) use it.
-- PUSH_AT (push_at.lua, D-3b) is its delayed form.
--
-- KEYS[1]  <ns>:queue:<q>
-- KEYS[2]  <ns>:queues
-- KEYS[3]  <ns>:locket:plans (hash: class -> published plan JSON; `*` and "" are the
--          fallback table and the [locket] defaults: src/config/published.rs); beside it,
--          <ns>:locket:holding_plans, the fields whose plan acts at enqueue (holds, unique)
-- ARGV[1]  queue name q
-- ARGV[2]  payload, exactly as it is to be pushed ({"class":"<Class>","args":[...]}, any
--          member order, spacing or extra members)
-- ARGV[3]  locket key prefix "<ns>:locket:"
--
-- Reply: {pushed, queue length, hold name...}: pushed is 1, or 0 for a duplicate the class's
-- `unique` refuses (U-1..U-4: its key `<ns>:locket:unique:<rendered unique_key>` is taken;
-- nothing is written but the `unique_refused` count), then the queue's length (after the
-- push) and the holds added with it.
-- While no published plan acts at enqueue, a push costs SCARD, SADD and RPUSH and the payload
-- is not read; else a class whose plan has no enqueue-time holds (or no plan) costs SCARD,
-- HMGET, SADD and RPUSH.
-- Errors, raised before anything is written:
--   LOCKET_RENDER ...  the payload cannot be read as a worker reads it (not JSON, not an object,
--                      no class, args not an array, nested too deeply), or a hold or unique
--                      template names a path the args do not have (T-6); while no plan acts
--                      at enqueue, any payload is pushed unread, as Resque pushes it;
--   LOCKET_PLAN ...    the class's plan is of a version this script does not know;
--   LOCKET_STORE ...   the queue key is not a list, `queues` not a set, or a hold's key not a
--                      hash (S-6).

-- Resque's own push, atomic without a TYPE call each: RPUSH first (a queue key of another
-- type raises before anything is written), then SADD; should `queues` be of another type,
-- the job just pushed is taken back (RPOP: nothing else ran in between) before the error.
local function resque_push()
  local len = redis.call('RPUSH', KEYS[1], ARGV[2])
  local added = redis.pcall('SADD', KEYS[2], ARGV[1])
  if type(added) == 'table' and added.err then
    redis.call('RPOP', KEYS[1])
    error({err = 'LOCKET_STORE push: ' .. KEYS[2] .. ': ' .. added.err .. '; nothing was changed'})
  end
  return {1, len}
end

local it = push_intent(KEYS[3], ARGV[3], ARGV[2], ARGV[1])
if not push_acts(it) then
  return resque_push()
end
must_be('push', KEYS[1], 'list')
must_be('push', KEYS[2], 'set')
push_checks(ARGV[3], it)
local now = now_ms()
local digest = render_digest(it.job)
if not push_take_unique(ARGV[3], it, digest) then
  return {0, redis.call('LLEN', KEYS[1])}
end
push_place_holds(ARGV[3], it, digest, now)
redis.call('SADD', KEYS[2], ARGV[1])
local reply = {1, redis.call('RPUSH', KEYS[1], ARGV[2])}
for _, name in ipairs(it.holds) do reply[#reply + 1] = name end
return reply
