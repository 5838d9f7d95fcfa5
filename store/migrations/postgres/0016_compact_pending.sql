-- Hours a flush wrote chunks for: once closed, the maintenance pass
-- rewrites each series' chunks of the hour as one (see compaction.rs),
-- finding them by the hour. Chunks go in roughly in time order, so a BRIN
-- index (a few pages a day) finds an hour's block ranges.
CREATE TABLE compact_pending (
    hour_ms BIGINT PRIMARY KEY
);
CREATE INDEX gpu_samples_packed_hour ON gpu_samples_packed USING brin (hour_ms);
CREATE INDEX process_samples_packed_hour ON process_samples_packed USING brin (hour_ms);
