-- PUSH_LIB: what PUSH (push.lua) and its delayed form PUSH_AT (push_at.lua) share: the
-- class plan's enqueue-time holds and `unique` key for one payload (locking-semantics.md
-- D-3a, D-3b, U-1), and their placement. At the chunk's level, after plans.lua.

-- What the published plan of the payload's class does at enqueue: nil while no published plan
-- acts at enqueue (`holding_plans` empty: the payload is not read), else
-- {job, holds = {rendered names}, ttl, unique = key or nil, unique_ttl}. Raises
-- LOCKET_RENDER / LOCKET_PLAN (nothing written).
local function push_intent(plans_key, prefix, payload, queue)
  if redis.call('SCARD', prefix .. 'holding_plans') == 0 then
    return nil
  end
  local job = render_payload(payload, queue)
  local found = redis.call('HMGET', plans_key, job.class, '*', '')
  local text = found[1] or found[2] or found[3]
  local it = {job = job, holds = {}, ttl = 0, unique = nil, unique_ttl = 0}
  if text then
    local plan = push_plan(text)
    it.ttl = plan.hold_ttl_ms
    for _, h in ipairs(plan.holds) do
      if h.when == 'enqueue' then
        it.holds[#it.holds + 1] = (render_template(h.name, job))
      end
    end
    if plan.unique then
      it.unique = prefix .. 'unique:' .. render_template(plan.unique.key, job)
      it.unique_ttl = tonumber(plan.unique.ttl_ms) or 0
    end
  end
  return it
end

-- Whether the intent places anything (a hold or a unique key).
local function push_acts(it)
  return it ~= nil and (#it.holds > 0 or it.unique ~= nil)
end

-- S-6: the keys the placement writes, checked before the first write (a hold key of another
-- type would raise after the unique key was taken).
local function push_checks(prefix, it)
  for _, name in ipairs(it.holds) do
    must_be('push', prefix .. 'dep:' .. name, 'hash')
  end
  if #it.holds > 0 then must_be('push', prefix .. 'deps', 'zset') end
end

-- U-1..U-4: takes the unique key for `digest`; false when it is taken (a duplicate: for
-- unique_ttl after the push that took it (until_expired), or while that job waits
-- (until_executing) or waits or runs (until_executed); those two set PX only with a unique_ttl
-- backstop). The caller then writes nothing but the `unique_refused` count. The first write of
-- a push.
local function push_take_unique(prefix, it, digest)
  if not it.unique then return true end
  local placed
  if it.unique_ttl > 0 then
    placed = redis.call('SET', it.unique, digest, 'NX', 'PX', it.unique_ttl)
  else
    placed = redis.call('SET', it.unique, digest, 'NX')
  end
  if not placed then
    count(prefix, nil, 'unique_refused', it.job.class)
    return false
  end
  return true
end

-- D-2, D-3: one hold of each enqueue-time name under `digest`, living hold_ttl from now.
local function push_place_holds(prefix, it, digest, now)
  for _, name in ipairs(it.holds) do
    hold_add(prefix, name, digest, it.ttl, now)
  end
  count(prefix, now, 'holds_added', '', #it.holds)
end
