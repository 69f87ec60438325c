-- WAKE DUE parked resources (parked-waits.md PK-4, PK-7; locking-semantics.md PK-4): a holder
-- whose lease lapsed without a release frees its unit with no script running, and a hold's
-- wake moves 1,000 entries a call. The janitor reads the `parked` index by score, at most
-- ARGV[2] resources a pass, and wakes the jobs of every one that has a free unit, as a
-- release would (lib_lock.lua); each is then due again when its earliest holder's lease ends.
--
-- KEYS[1]  <ns>:locket:parked
-- ARGV[1]  locket key prefix "<ns>:locket:" (the resources' keys are built here: S-1)
-- ARGV[2]  batch size (at most 100)
-- ARGV[3]  park_check_interval in ms
--
-- A rate's list ("rate:<key>", rate-limits.md RL-3) wakes as many entries as the key allows
-- now, and is due again shortly after (the woken jobs' starts are then in its log), or at the
-- time its next start is allowed.
--
-- Returns {woken, pending, stuck...}: the jobs woken; while the index still names a resource
-- (so the janitor keeps looking), 1 + the ms until the next look (park_check_interval, or
-- less when a rate's next start is due sooner), else 0; then each resource whose
-- first entry cannot move (its list, its lock or its queue holds another type; PK-6): it is
-- due again in a minute, so that it is reported once a minute. Raises nothing.

-- Nothing parked anywhere (the common case): one command.
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if #head == 0 then return {0, 0} end
local prefix = ARGV[1]
local now = now_ms()
local every = tonumber(ARGV[3])
-- Nothing due yet (another process's look came first, or the earliest is later): two
-- commands, and the next look when the earliest is due (at most park_check_interval away).
if tonumber(head[2]) > now then
  return {0, 1 + math.min(tonumber(head[2]) - now, every)}
end
local members = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', int(now), 'LIMIT', 0, tonumber(ARGV[2]))
local woken = 0
local out = {0, 0}
-- The limit the first entry of a list asked for (0 when it cannot be read).
local function first_entry(pk)
  local e = redis.pcall('LINDEX', pk, 0)
  if type(e) ~= 'string' then return {} end
  local ok, d = pcall(cjson.decode, e)
  if not ok or type(d) ~= 'table' then return {} end
  return d
end
local function first_limit(pk)
  return tonumber(first_entry(pk)['limit']) or 0
end
for _, res in ipairs(members) do
  local pk = prefix .. 'parked:' .. res
  local len = redis.pcall('LLEN', pk)
  local next_at = now + every
  local stuck = false
  if type(len) ~= 'number' then
    stuck = true
  elseif len == 0 then
    redis.call('ZREM', KEYS[1], res)
    next_at = nil
  else
    local kind, id = string.match(res, '^(%a+):(.*)$')
    if kind == 'lock' then
      local lk = prefix .. 'lock:' .. id
      local t = redis.call('TYPE', lk)['ok']
      if t == 'string' then
        -- Held (a holder, or a handoff on its way): its release wakes; make sure it knows.
        lock1_mark_parked(lk)
        next_at = now + math.max(redis.call('PTTL', lk), every)
      elseif t == 'none' or t == 'zset' then
        local limit = first_limit(pk)
        local holders, by_purge = 0, 0
        if t == 'zset' then
          local ik, bk = prefix .. 'lockinfo:' .. id, prefix .. 'blocked:lock:' .. id
          local before = redis.call('LLEN', pk)
          local purged = purge_expired(lk, ik, bk, now, prefix .. 'counter:')
          if purged > 0 then
            fix_lock(lk, ik, prefix .. 'locks', id)
            count(prefix, now, 'expired', '', purged)
            by_purge = before - redis.call('LLEN', pk)
            woken = woken + by_purge
          end
          -- L-1b: the purge's wake made the lock a parked limit-1 job's handoff (lib_park.lua).
          if known[lk] then t = 'string' end
        end
        if t == 'zset' then
          holders = redis.call('ZCARD', lk)
          local first = redis.call('ZRANGE', lk, 0, 0, 'WITHSCORES')
          if #first > 0 then next_at = math.max(tonumber(first[2]), now + every) end
        end
        if t == 'string' then
          next_at = now + every
        elseif limit <= 1 and t == 'none' then
          if lock1_handoff(prefix, lk, id) then
            woken = woken + 1
            next_at = now + every
          else
            stuck = true
          end
        else
          -- The purge's own wakes kept their units (lockn_handoff): they count in holders. With
          -- no unit free, a job whose unit is kept already may still start now (L-1b).
          local moved, _, bad = lockn_handoff(prefix, id, math.max(limit - holders, 0))
          woken = woken + #moved
          stuck = bad and #moved == 0
        end
      else
        stuck = true
      end
    elseif kind == 'rate' then
      -- RL-3: as many as the key allows now; the entry carries the rate's settings.
      local d = first_entry(pk)
      local r = {id, tonumber(d['limit']) or 0, tonumber(d['period']) or 0, d['spread']}
      local n, at, used, l = nil, now, 0, nil
      if r[2] > 0 and r[3] > 0 then n, at, used, l = rate_free(prefix, r, now) end
      if n == nil then
        stuck = true
      elseif n > 0 then
        local moved, _, bad = parked_wake(prefix, res, n)
        woken = woken + #moved
        stuck = bad and #moved == 0
        -- Due again when the oldest start in the window lapses (the woken jobs' starts are
        -- logged by then), else shortly, once they have started.
        next_at = rate_after(prefix, l, r, used) or (now + math.min(every, 100))
        next_at = math.max(next_at, now + 5)
      else
        next_at = at
      end
    elseif kind == 'dep' then
      local before = len
      local total = dep_state(prefix, id, now)
      if total == 0 then
        local after = redis.pcall('LLEN', pk)
        if type(after) == 'number' then
          woken = woken + before - after
          stuck = after == before
        end
        next_at = now
      else
        local first = redis.call('ZSCORE', prefix .. 'deps', id)
        if first then next_at = math.max(tonumber(first), now + every) end
      end
    end
  end
  if stuck then
    out[#out + 1] = res
    next_at = now + 60000
  end
  -- XX: a wake that emptied the list took the resource out of the index.
  if next_at then redis.call('ZADD', KEYS[1], 'XX', int(next_at), res) end
end
out[1] = woken
-- The next look: park_check_interval, or sooner when a rate's next start comes first among
-- the earliest ten (RL-3). Locks and holds keep their interval (PK-4).
head = redis.call('ZRANGE', KEYS[1], 0, 9, 'WITHSCORES')
if #head > 0 then
  local soon = every
  for i = 1, #head, 2 do
    if string.sub(head[i], 1, 5) == 'rate:' then
      soon = math.max(math.min(tonumber(head[i + 1]) - now, every), 0)
      break
    end
  end
  out[2] = 1 + soon
end
return out
