-- Allocator reports written as compressed chunks at a flush of the open
-- chunks, as Postgres writes them (its 0027), instead of a row per report.
-- Rows written before this release stay in allocator_samples, chart beside
-- the chunks and expire with raw retention.
CREATE TABLE allocator_samples_packed (
    process_id  BIGINT  NOT NULL,
    hour_ms     BIGINT  NOT NULL,
    first_ts_ms BIGINT  NOT NULL,
    last_ts_ms  BIGINT  NOT NULL,
    samples     INTEGER NOT NULL,
    data        BLOB    NOT NULL
);
CREATE INDEX allocator_samples_packed_process_hour ON allocator_samples_packed (process_id, hour_ms);
CREATE INDEX allocator_samples_packed_hour ON allocator_samples_packed (hour_ms);
