-- DELIVER one batch of a due timestamp of resque-scheduler's delayed queue to the work queues
-- (scheduler-protocol.md SC-4, SC-5), atomically: read, SREM the item's index, push the work
-- payload, trim the delivered items, and drop the bucket and its ZSET entry once it is empty.
-- Items are opaque bytes (SC-1): a copy is parsed; the work payload is
-- {"class":<class>,"args":<args>} with both values copied as the item's raw JSON text.
--
-- KEYS[1]  <ns>:delayed_queue_schedule
-- KEYS[2]  <ns>:queues
-- KEYS[3]  <ns>:delayed:<ts>
-- ARGV[1]  Resque key prefix "<ns>:"
-- ARGV[2]  the ZSET member <ts>, as stored
-- ARGV[3]  offset: items at the head of the bucket kept back by earlier batches of this pass
-- ARGV[4]  batch size (at most 100)
-- ARGV[5]  bytes: no item is read once the batch's items add up to this many (at least one
--          item is read, so a batch reads at most this plus one item)
--
-- Returns {delivered, kept, left, i1, why1, i2, why2, ...}: items pushed, items now kept at
-- the head (offset included), LLEN after (-1: the bucket is not a list), then each item this
-- batch kept (its index in the bucket and why). A kept item (no usable queue, unreadable, a
-- target key of another type) stays in place, untouched. Every check is made before the
-- first write (S-6); raises a LOCKET_STORE error, having changed nothing, when `queues` is not
-- a set or `delayed_queue_schedule` not a sorted set (its ZREM comes after the writes).

must_be('deliver', KEYS[1], 'zset')
must_be('deliver', KEYS[2], 'set')
local prefix, bucket = ARGV[1], KEYS[3]
local btype = redis.call('TYPE', bucket)['ok']
if btype == 'none' then
  -- A stale entry: remove_delayed emptied the bucket and left the ZSET entry (SC-2).
  redis.call('ZREM', KEYS[1], ARGV[2])
  return {0, 0, 0}
end
if btype ~= 'list' then
  return {0, 0, -1, -1, 'WRONGTYPE ' .. bucket .. ' holds a ' .. btype .. ', not a list'}
end

-- The index of the last byte of the JSON value starting at byte i of s, or nil.
local function value_end(s, i)
  local c = string.sub(s, i, i)
  if c == '"' then
    local j = i + 1
    while true do
      local k = string.find(s, '["\\]', j)
      if not k then return nil end
      if string.sub(s, k, k) == '\\' then j = k + 2 else return k end
    end
  elseif c == '{' or c == '[' then
    local depth, j = 0, i
    while true do
      local k = string.find(s, '[%[%]{}"]', j)
      if not k then return nil end
      local ch = string.sub(s, k, k)
      if ch == '"' then
        local e = value_end(s, k)
        if not e then return nil end
        j = e + 1
      else
        if ch == '{' or ch == '[' then depth = depth + 1 else depth = depth - 1 end
        if depth == 0 then return k end
        j = k + 1
      end
    end
  elseif c == '' then
    return nil
  else
    local k = string.find(s, '[,}%]%s]', i)
    if not k then return #s end
    return k - 1
  end
end

local function skip_ws(s, i) return string.find(s, '[^ \t\r\n]', i) end

-- The raw text of each top-level member of the JSON object s, by its raw key ("\"args\""),
-- or nil when s is not an object this scanner reads.
local function members(s)
  local out = {}
  local i = skip_ws(s, 1)
  if not i or string.sub(s, i, i) ~= '{' then return nil end
  i = skip_ws(s, i + 1)
  if i and string.sub(s, i, i) == '}' then return out end
  while i do
    if string.sub(s, i, i) ~= '"' then return nil end
    local ke = value_end(s, i)
    if not ke then return nil end
    local key = string.sub(s, i, ke)
    i = skip_ws(s, ke + 1)
    if not i or string.sub(s, i, i) ~= ':' then return nil end
    i = skip_ws(s, i + 1)
    if not i then return nil end
    local ve = value_end(s, i)
    if not ve then return nil end
    out[key] = string.sub(s, i, ve)
    i = skip_ws(s, ve + 1)
    if not i then return nil end
    local c = string.sub(s, i, i)
    if c == '}' then return out end
    if c ~= ',' then return nil end
    i = skip_ws(s, i + 1)
  end
  return nil
end

-- The queue and work payload of a delayed item, or nil and why not.
local function parse_item(item)
  local ok, d = pcall(cjson.decode, item)
  if not ok or type(d) ~= 'table' then return nil, nil, 'not a JSON object' end
  if type(d['queue']) ~= 'string' or d['queue'] == '' then return nil, nil, 'no queue' end
  if type(d['class']) ~= 'string' or d['class'] == '' then return nil, nil, 'no class' end
  local m = members(item)
  if not m or not m['"class"'] then return nil, nil, 'unreadable' end
  local args = m['"args"'] or '[]'
  return d['queue'], '{"class":' .. m['"class"'] .. ',"args":' .. args .. '}', nil
end

-- The batch, read one item at a time until ARGV[4] items or ARGV[5] bytes: a bucket of items
-- of several MB each must not hold Redis (and Lua's memory) for a whole batch of 100.
local offset, max_bytes = tonumber(ARGV[3]), tonumber(ARGV[5])
local items, bytes = {}, 0
for i = 0, tonumber(ARGV[4]) - 1 do
  if bytes >= max_bytes then break end
  local item = redis.call('LINDEX', bucket, offset + i)
  if not item then break end
  items[#items + 1] = item
  bytes = bytes + #item
end
local member = 'delayed:' .. ARGV[2]
-- First pass: every check, no write.
local plan, kept, types = {}, {}, {}
local function type_of(key)
  local t = types[key]
  if t == nil then
    t = redis.call('TYPE', key)['ok']
    types[key] = t
  end
  return t
end
for i, item in ipairs(items) do
  local q, payload, why = parse_item(item)
  if q then
    local t = type_of(prefix .. 'queue:' .. q)
    if t ~= 'none' and t ~= 'list' then
      why = 'WRONGTYPE ' .. prefix .. 'queue:' .. q .. ' holds a ' .. t .. ', not a list'
    end
  end
  if not why then
    local t = type_of(prefix .. 'timestamps:' .. item)
    if t ~= 'none' and t ~= 'set' then
      why = 'WRONGTYPE ' .. prefix .. 'timestamps:<item> holds a ' .. t .. ', not a set'
    end
  end
  if why then
    kept[#kept + 1] = offset + i - 1
    kept[#kept + 1] = why
  else
    plan[i] = {q, payload}
  end
end
-- Second pass: the writes.
local delivered = 0
for i, item in ipairs(items) do
  local p = plan[i]
  if p then
    redis.call('SREM', prefix .. 'timestamps:' .. item, member)
    redis.call('RPUSH', prefix .. 'queue:' .. p[1], p[2])
    redis.call('SADD', KEYS[2], p[1])
    delivered = delivered + 1
  end
end
if delivered == #items and offset == 0 then
  if delivered > 0 then redis.call('LTRIM', bucket, delivered, -1) end
elseif delivered > 0 then
  -- Kept items stay where they are: the delivered ones are marked, then removed. The mark
  -- cannot be a JSON item.
  local mark = '\0locketd:delivered\0'
  for i, _ in ipairs(items) do
    if plan[i] then redis.call('LSET', bucket, offset + i - 1, mark) end
  end
  redis.call('LREM', bucket, 0, mark)
end
local left = redis.call('LLEN', bucket)
if left == 0 then
  redis.call('DEL', bucket)
  redis.call('ZREM', KEYS[1], ARGV[2])
end
local reply = {delivered, offset + #kept / 2, left}
for _, v in ipairs(kept) do reply[#reply + 1] = v end
return reply
