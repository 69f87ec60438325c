-- BATCH: several calls of the job-path scripts in one EVALSHA (the multi-slot mode's
-- connection, src/store/batch.rs, gathers the calls its slots make at the same moment). Each
-- call runs the unchanged body of its script, wrapped by src/store/scripts.rs as a function
-- of its own KEYS and ARGV, in the order the calls arrived; the batch is one atomic step, so
-- every rule that holds for one call holds for each call of a batch. The O-3 counts and
-- Resque's stat counters of all the calls are written once, at the end.
--
-- KEYS         the keys of every call, call after call
-- ARGV[1]      m, the number of calls
-- ARGV[2+3j]   for call j = 0..m-1: its script ("reserve", "acquire", "finish" or
-- ARGV[3+3j]   "finish_reserve" or "take"), its number of keys and its number of arguments
-- ARGV[4+3j]
-- ARGV[2+3m..] the arguments of every call, call after call
--
-- Returns one reply per call, in order. A call that raised returns
-- {"__locket_batch_error__", message} instead; the others are not affected.

local ops = {
  reserve = reserve_part,
  acquire = acquire_part,
  finish = finish_part,
  finish_reserve = finish_reserve_part,
  take = take_part,
}
local reads_of = {
  reserve = reserve_reads,
  acquire = acquire_reads,
  finish = finish_reads,
  finish_reserve = finish_reserve_reads,
  take = take_reads,
}
local m = tonumber(ARGV[1])
-- The calls' KEYS and ARGV, cut out first, so that one MGET reads what all of them read
-- (lib.lua, prefetch).
local calls = {}
local reads = {}
local ki, ai = 1, 2 + 3 * m
for j = 0, m - 1 do
  local op, nk, na = ARGV[2 + 3 * j], tonumber(ARGV[3 + 3 * j]), tonumber(ARGV[4 + 3 * j])
  local k, a = slice(KEYS, ki, ki + nk - 1), slice(ARGV, ai, ai + na - 1)
  ki, ai = ki + nk, ai + na
  calls[j + 1] = {op, k, a}
  local r = reads_of[op]
  if r then
    local ok, list = pcall(r, k, a)
    if ok then
      for _, key in ipairs(list) do reads[#reads + 1] = key end
    end
  end
end
prefetch(reads)
reads_done = true
local out = {}
for j = 0, m - 1 do
  local op, k, a = calls[j + 1][1], calls[j + 1][2], calls[j + 1][3]
  local f = ops[op]
  local reply
  if f == nil then
    reply = {'__locket_batch_error__', 'unknown script in batch: ' .. tostring(op)}
  else
    local ok, r = pcall(f, k, a)
    if ok then
      reply = r
    else
      if type(r) == 'table' and r.err then r = r.err end
      reply = {'__locket_batch_error__', tostring(r)}
    end
  end
  if reply == nil then reply = false end
  out[j + 1] = reply
end
return out
