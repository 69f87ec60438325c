-- PARK: marks a slot's inflight record as parked (E-3), for `locketd status` to show. Written
-- once, when Redis has refused the record's FINISH; the FINISH that lands later deletes the
-- record with the marks. rid-checked, so it never creates a record nor marks another job's.
--
-- KEYS[1]  <ns>:locket:inflight:<slot key>
-- ARGV[1]  rid
-- ARGV[2]  parked_at: when (Resque's time format)
-- ARGV[3]  parked_why: the refusal, as Redis gave it
--
-- Returns 1 when marked, 0 when the record is not this reservation's. Its one write is its
-- last call (S-6).

if redis.call('HGET', KEYS[1], 'rid') ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'parked_at', ARGV[2], 'parked_why', ARGV[3])
return 1
