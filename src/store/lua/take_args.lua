-- TAKE's arguments as the changes from the slot's last TAKE (locking-semantics.md A-7a, "the
-- arguments"; src/store/fcall.rs sends them). Only the FUNCTION library has this entry: a
-- library keeps its Lua values between calls, where an EVAL script starts afresh.
--
-- A TAKE names about 50 keys and arguments, and most are the same call after call (the slot's
-- keys, its worker's name, the TTLs, the lockinfo head): each costs Redis its parse, a string
-- object and a Lua string, about 1.5 k instructions, more than the step's whole plan lookup.
-- So the worker sends the whole list once, and then only the entries that changed; this
-- entry keeps the slot's list, applies the changes to it, and runs TAKE with it: TAKE gets the
-- very keys and arguments the whole call would have given it.
--
-- ARGV[1]   the stream: the slot's inflight key (one list per slot)
-- ARGV[2]   "" for a whole list, else the version of the list the changes apply to
-- ARGV[3]   the version of the list this call makes
-- a whole list:
-- ARGV[4]   the number of keys n
-- ARGV[5..] the keys, then the arguments, as a TAKE's
-- changes:
-- ARGV[4]   the positions in the list (keys first, from 1) that change, one byte each
-- ARGV[5..] their new values, in the same order
--
-- Returns TAKE's reply, or the error LOCKET_ARGS_MISS, having changed nothing, when this
-- library holds no list of that version for the stream (Redis restarted, the library loaded
-- again, the list dropped for room): the worker then sends the whole list.
--
-- A TAKE neither writes to its KEYS and ARGV nor keeps them, so the kept list is handed to it
-- as it is, with no copy. At most 1,024 streams are kept (a dead slot's list stays until then):
-- past that, all are dropped, and each slot sends its whole list once more.
local args_lists, args_count = {}, 0

local function args_delta(f)
  return function(_, ARGV)
    local stream, base = ARGV[1], ARGV[2]
    local l
    if base == '' then
      local n = tonumber(ARGV[4])
      if args_count >= 1024 then args_lists, args_count = {}, 0 end
      if not args_lists[stream] then args_count = args_count + 1 end
      l = {n = n, K = {unpack(ARGV, 5, 4 + n)}, A = {unpack(ARGV, 5 + n)}}
      args_lists[stream] = l
    else
      l = args_lists[stream]
      if not l or l.ver ~= base then return redis.error_reply('LOCKET_ARGS_MISS') end
      local K, A, n = l.K, l.A, l.n
      local at = {string.byte(ARGV[4], 1, -1)}
      for j = 1, #at do
        local p = at[j]
        if p <= n then K[p] = ARGV[4 + j] else A[p - n] = ARGV[4 + j] end
      end
    end
    l.ver = ARGV[3]
    return f(l.K, l.A)
  end
end
