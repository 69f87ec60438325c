-- FINISH of one job and RESERVE of the next, in one round trip (the no-conflict path then
-- costs two round trips per job: FINISH+RESERVE, ACQUIRE+START). The two bodies are the
-- unchanged finish.lua and reserve.lua, wrapped by src/store/scripts.rs as
-- finish_part(KEYS, ARGV) and reserve_part(KEYS, ARGV); FINISH runs first, so the slot's
-- inflight record is free again when RESERVE checks it.
--
-- KEYS         finish.lua's keys, then reserve.lua's keys
-- ARGV[1]      number of finish.lua's keys
-- ARGV[2]      number of finish.lua's arguments
-- ARGV[3..]    finish.lua's arguments, then reserve.lua's arguments
--
-- Returns {finish.lua's reply, reserve.lua's reply}. When RESERVE raises, its reply is
-- {"__locket_reserve_error__", message}: the FINISH has landed either way, and the worker must
-- not send it again (a second FINISH would find "missing" and release the job's holds twice).

local fk, fa, rk, ra = split_finish_reserve(KEYS, ARGV)
-- One MGET for what both parts read (lib.lua, prefetch).
if not reads_done then
  prefetch(finish_reserve_reads(KEYS, ARGV))
  reads_done = true
end
local finished = finish_part(fk, fa)
local ok, reserved = pcall(reserve_part, rk, ra)
if not ok then
  if type(reserved) == 'table' and reserved.err then reserved = reserved.err end
  reserved = {'__locket_reserve_error__', tostring(reserved)}
end
return {finished, reserved}
