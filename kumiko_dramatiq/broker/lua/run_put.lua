-- run_put: write one run record outside a delivery (boot gates, cancellations).
-- KEYS[1] the run hash ("<root>run:<message id>"; the indexes are derived from ARGV[1])
-- ARGV[1] run history root "kumiko:<prefix>:"   ARGV[2] message id   ARGV[3] attempt
-- ARGV[4] job   ARGV[5] status   ARGV[6] tenant ("" = none)   ARGV[7] origin id
-- ARGV[8] time of the write (ms)   ARGV[9] the record (JSON)   ARGV[10] TTL (ms) of completed
-- and cancelled records   ARGV[11] TTL (ms) of running, failed and dead ones   ARGV[12] cap
-- ARGV[13] trim budget: how many old index entries trim_runs may drop now (0 = no trim)
-- ARGV[14] the record's order score: the attempt's start in ms (its enqueue time if it never
-- started); "" = the time of the write
-- Returns 1.
-- @include ttl
-- @include history
local at = tonumber(ARGV[8])
put_run(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], tonumber(ARGV[14]) or at,
    ARGV[9], ttl_ms(ARGV[10], "completed run record"), ttl_ms(ARGV[11], "failed run record"), at)
flush_runs()
if tonumber(ARGV[13]) > 0 then
    trim_runs(ARGV[1], tonumber(ARGV[12]), tonumber(ARGV[13]), tonumber(ARGV[10]),
        tonumber(ARGV[11]), at, ARGV[4])
end
return 1
