
-- Unique entries that follow their job (locking-semantics.md U-2..U-4), the third part of the
-- shared helpers: scripts.rs appends this file after lib_park.lua.
--
-- A job of a class with `unique = "until_executing"` or `"until_executed"` carries its entry's
-- spec, the JSON array [key, policy, ttl_ms]: key the full `<ns>:locket:unique:<rendered
-- unique_key>`, policy the word, ttl_ms the backstop lifetime (0: none). The worker sends it
-- to ACQUIRE (option `unique`) and FINISH (ARGV[12]); START writes it to the inflight record
-- (field `unique`) for recovery; a parked entry and a delayed member carry it (member
-- `unique`) for the operator's cancel. The entry's value is the job's digest: every release
-- compares it first, so a job never removes an entry a different job placed.
-- No call here can raise (GET through pcall: a key of another type is not this job's entry;
-- SET NX and DEL take any type), so a script may call these after its first write (S-6).
local unique_entry = {}

-- A spec decoded from its JSON, or nil when it is not one.
unique_entry.decode = function(text)
  if type(text) ~= 'string' or text == '' then return nil end
  local ok, s = pcall(cjson.decode, text)
  if not ok or type(s) ~= 'table' or type(s[1]) ~= 'string' then return nil end
  return s
end

-- Compare-and-delete: deletes `key` only if its value is `digest`. Returns 1 when deleted.
unique_entry.release = function(prefix, key, digest, class)
  local v = redis.pcall('GET', key)
  if type(v) ~= 'string' or v ~= digest then return 0 end
  redis.call('DEL', key)
  count(prefix, nil, 'unique_released', class or '')
  return 1
end

-- The job waits again: its entry is placed if the key is free (SET NX, PX only with a
-- backstop); a duplicate pushed meanwhile keeps its own. Returns 1 when placed.
unique_entry.replace = function(prefix, key, digest, ttl_ms, class)
  local ttl = tonumber(ttl_ms) or 0
  local done
  if ttl > 0 then
    done = redis.call('SET', key, digest, 'NX', 'PX', int(ttl))
  else
    done = redis.call('SET', key, digest, 'NX')
  end
  if not done then return 0 end
  count(prefix, nil, 'unique_replaced', class or '')
  return 1
end

-- What the step that ends a started job's run does with its entry (U-3 table), by the spec
-- `s` and what became of the job: "success", "failure" (failed, recorded in the failed list
-- or not), or "waits" (back in its queue, parked or delayed).
unique_entry.settle = function(prefix, s, digest, what, class)
  if not s then return end
  if what == 'waits' then
    unique_entry.replace(prefix, s[1], digest, s[3], class)
  elseif s[2] == 'until_executed' then
    unique_entry.release(prefix, s[1], digest, class)
  end
end
