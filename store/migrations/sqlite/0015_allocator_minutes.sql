-- An allocator chunk of more than a few minutes (an hour compacted, a
-- spool replayed) keeps its reports folded a minute each, as chart points:
-- a chart of minute-wide buckets or wider reads those, not every report
-- (Postgres' 0028). The table is made anew to put the column before the
-- reports: SQLite reaches a column after a large BLOB only by walking the
-- BLOB's overflow pages. Chunks written before stay without (NULL) and
-- chart from their reports until retention drops them.
CREATE TABLE allocator_samples_packed_new (
    process_id  BIGINT  NOT NULL,
    hour_ms     BIGINT  NOT NULL,
    first_ts_ms BIGINT  NOT NULL,
    last_ts_ms  BIGINT  NOT NULL,
    samples     INTEGER NOT NULL,
    minutes     BLOB,
    data        BLOB    NOT NULL
);
INSERT INTO allocator_samples_packed_new (process_id, hour_ms, first_ts_ms, last_ts_ms, samples, data)
    SELECT process_id, hour_ms, first_ts_ms, last_ts_ms, samples, data FROM allocator_samples_packed;
DROP TABLE allocator_samples_packed;
ALTER TABLE allocator_samples_packed_new RENAME TO allocator_samples_packed;
CREATE INDEX allocator_samples_packed_process_hour ON allocator_samples_packed (process_id, hour_ms);
CREATE INDEX allocator_samples_packed_hour ON allocator_samples_packed (hour_ms);
