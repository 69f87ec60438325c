-- PUSH a job the way Resque pushes it, with the enqueue-time holds (`when = "enqueue"`) that
-- its class's published plan names, rendered here from the exact payload bytes (locking-
-- semantics.md D-3, D-3a; render.lua). The one enqueue path: `locketd enqueue`, the Rust
-- client, and any client that can send FCALL (or EVALSHA of the same script) use it.
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
--   LOCKET_STORE ...   the queue key is not a list or `queues` not a set (S-6).

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

-- No published plan acts at enqueue: Resque's own push, the payload unread.
if redis.call('SCARD', ARGV[3] .. 'holding_plans') == 0 then
  return resque_push()
end
local job = render_payload(ARGV[2], ARGV[1])
local found = redis.call('HMGET', KEYS[3], job.class, '*', '')
local text = found[1] or found[2] or found[3]
local holds = {}
local ttl = 0
local unique, unique_ttl = nil, 0
if text then
  local plan = push_plan(text)
  ttl = plan.hold_ttl_ms
  for _, h in ipairs(plan.holds) do
    if h.when == 'enqueue' then
      holds[#holds + 1] = (render_template(h.name, job))
    end
  end
  if plan.unique then
    unique = ARGV[3] .. 'unique:' .. render_template(plan.unique.key, job)
    unique_ttl = tonumber(plan.unique.ttl_ms) or 0
  end
end
if #holds == 0 and not unique then
  return resque_push()
end
must_be('push', KEYS[1], 'list')
must_be('push', KEYS[2], 'set')
local now = now_ms()
local digest = render_digest(job)
-- U-1..U-4: a duplicate is not pushed while the key is taken: for unique_ttl after the push
-- that took it (until_expired), or while that job waits (until_executing) or waits or runs
-- (until_executed); those two set PX only with a unique_ttl backstop.
if unique then
  local placed
  if unique_ttl > 0 then
    placed = redis.call('SET', unique, digest, 'NX', 'PX', unique_ttl)
  else
    placed = redis.call('SET', unique, digest, 'NX')
  end
  if not placed then
    count(ARGV[3], nil, 'unique_refused', job.class)
    return {0, redis.call('LLEN', KEYS[1])}
  end
end
for _, name in ipairs(holds) do
  hold_add(ARGV[3], name, digest, ttl, now)
end
count(ARGV[3], now, 'holds_added', '', #holds)
redis.call('SADD', KEYS[2], ARGV[1])
local reply = {1, redis.call('RPUSH', KEYS[1], ARGV[2])}
for _, name in ipairs(holds) do reply[#reply + 1] = name end
return reply
