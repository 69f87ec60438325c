-- Counting and small helpers (O-3, stats): the per-run counts and their flush, Resque's
-- counters written at the end of a step, Resque's heartbeat time format, and the locket
-- prefix. Appended after lib_lock.lua by src/store/scripts.rs.

local function is_true(v)
  return v and string.lower((string.gsub(v, '^%s*(.-)%s*$', '%1'))) == 'true'
end

-- Epoch seconds as Ruby's Time#iso8601 in UTC, "2026-11-21T12:18:29+00:00": the form Resque
-- writes into workers:heartbeat (from the Redis clock, resque-protocol.md §4).
local function iso8601(secs)
  local days = math.floor(secs / 86400)
  local rem = secs - days * 86400
  -- civil-from-days (proleptic Gregorian), days since 1970-01-01
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local y = yoe + era * 400
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp + 3
  if m > 12 then m = m - 12 end
  if m <= 2 then y = y + 1 end
  return string.format('%04d-%02d-%02dT%02d:%02d:%02d+00:00', y, m, d,
    math.floor(rem / 3600), math.floor((rem % 3600) / 60), rem % 60)
end

-- t[k], a table, made empty the first time it is asked for (the memos' nested tables).
local function child(t, k)
  local c = t[k]
  if c == nil then
    c = {}
    t[k] = c
  end
  return c
end
-- Empties table t in place (a table kept and emptied costs less than one made anew).
local function clear(t)
  for k in pairs(t) do t[k] = nil end
end

-- O-3: count an event (`<event>`, and `<event>|<class>` when a class is given). Counts are
-- summed in Lua. The job-path steps (RESERVE, ACQUIRE, FINISH and their batches) hand them to
-- the worker with their reply (`counts_reply`, set by src/store/scripts.rs): the worker adds
-- them up in memory and writes stat:<event> and the metrics:<epoch minute> bucket at most once
-- per second (src/store/tally.rs), so they cost the job path nothing. The other steps (janitor,
-- admin, scheduler: seconds apart) write theirs at their end, in flush_counts().
local counts, counts_prefix, counts_bucket = {}, nil, nil
local counts_reply = false
-- "<event>|<class>" field names, made once and kept across runs: event -> class -> field.
local class_fields = {}
-- A counted field's entry in the joined reply when its count is 1 (flush_counts), made once and
-- kept across runs: field -> entry.
local one_entries = {}
local function count(prefix, now, event, class, n)
  n = n or 1
  if n == 0 then return end
  if counts_prefix == nil then
    counts_prefix = prefix
    if not counts_reply then
      counts_bucket = prefix .. 'metrics:' .. int(math.floor((now or now_ms()) / 60000))
    end
  end
  counts[event] = (counts[event] or 0) + n
  if class and class ~= '' then
    local fields = child(class_fields, event)
    local f = fields[class]
    if f == nil then
      f = event .. '|' .. class
      fields[class] = f
    end
    counts[f] = (counts[f] or 0) + n
  end
end

-- A-1: `payload`, popped from `queue`, becomes the reservation in slot record `inflight`
-- (RESERVE's write: reserve.lua, and FINISH+RESERVE's short path).
local function record_reservation(inflight, prefix, rid, worker, queue, payload, now)
  redis.call('HSET', inflight,
    'rid', rid,
    'queue', queue,
    'payload', payload,
    'reserved_at', int(now),
    'state', 'reserved',
    'resque_worker', worker)
  inflight_freed[inflight] = nil
  count(prefix, now, 'reserved', '')
end

-- Resque's own counters (stat:processed and the like) are summed the same way and always
-- written in the step (they stay exact, per job): a batch of FINISHes writes stat:processed once.
local incrs = {}
local function incr_later(key, n)
  incrs[key] = (incrs[key] or 0) + (n or 1)
end

-- Writes the Resque counters summed by incr_later() and, unless counts_reply is set, the
-- counts summed by count(); returns the counts when it is set, as one string of entries
-- `<n>,<length of field>:<field>` (src/store/tally.rs reads it): one bulk string costs
-- Redis and the worker's parser far less than a reply element per field and per number.
-- The bucket gets its 8 h expiry when one of its event fields is created (event names hold no
-- '|'; the class fields do).
-- RL-5: the per-class counts that /metrics reads fleet-wide from `<prefix>rate_stats` as
-- well (src/store/tally.rs keeps the same list).
local function is_rate_stat(field)
  return string.sub(field, 1, 13) == 'rate_limited|' or string.sub(field, 1, 10) == 'throttled|'
end

local function flush_counts()
  -- Counts are observability: a counter key another tool made a non-integer or another type
  -- is passed over (redis.pcall), so it never fails the step whose writes are already made.
  for key, n in pairs(incrs) do
    redis.pcall('INCRBY', key, int(n))
  end
  clear(incrs)
  if counts_reply then
    local parts, i = {}, 0
    for field, n in pairs(counts) do
      i = i + 1
      local e
      if n == 1 then
        e = one_entries[field]
        if e == nil then
          e = '1,' .. #field .. ':' .. field
          one_entries[field] = e
        end
      else
        e = int(n) .. ',' .. #field .. ':' .. field
      end
      parts[i] = e
    end
    clear(counts)
    counts_prefix = nil
    return table.concat(parts)
  end
  if counts_prefix == nil then return end
  local m = counts_bucket
  local fresh = false
  for field, n in pairs(counts) do
    local s = int(n)
    if string.find(field, '|', 1, true) then
      redis.pcall('HINCRBY', m, field, s)
      if is_rate_stat(field) then redis.pcall('HINCRBY', counts_prefix .. 'rate_stats', field, s) end
    else
      redis.pcall('INCRBY', counts_prefix .. 'stat:' .. field, s)
      if redis.pcall('HINCRBY', m, field, s) == n then fresh = true end
    end
  end
  if fresh then redis.pcall('PEXPIRE', m, '28800000') end
  clear(counts)
  counts_prefix, counts_bucket = nil, nil
end

-- "<ns>:locket:" from the counter prefix "<ns>:locket:counter:" the scripts already receive.
local locket_prefixes = {}
local function locket_prefix(counter_prefix)
  local p = locket_prefixes[counter_prefix]
  if p == nil then
    p = string.sub(counter_prefix, 1, #counter_prefix - 8)
    locket_prefixes[counter_prefix] = p
  end
  return p
end
