-- Hours to roll up again for some series only. A flush that merges minutes
-- before the minute watermark (a spool replayed after an outage) used to
-- mark their whole hour, which the pass then redid for every series of the
-- fleet (about 28 s of Postgres at 100,000 GPUs for one late sample). It
-- now marks the series it merged, a row per series and hour, and the pass
-- redoes their hours alone and sums the fleet's hour again. Rows repeat as
-- a replay's flushes mark the same series; the pass takes them all.
CREATE TABLE hour_redo_series (
    hour_ms   BIGINT  NOT NULL,
    process   BOOLEAN NOT NULL,
    series_id BIGINT  NOT NULL
);
CREATE INDEX hour_redo_series_hour ON hour_redo_series (hour_ms);
