-- Raw GPU and process samples a day old or more are packed by maintenance
-- into one compressed chunk per series (device, process) and hour
-- (store/postgres/packed.rs): a few bytes per sample instead of 90 to 140.
-- Partitioned by day like the raw tables and dropped with them by retention.
CREATE TABLE gpu_samples_packed (
    hour_ms     BIGINT  NOT NULL,
    first_ts_ms BIGINT  NOT NULL,
    last_ts_ms  BIGINT  NOT NULL,
    device_id   INTEGER NOT NULL,
    samples     INTEGER NOT NULL,
    data        BYTEA   NOT NULL
) PARTITION BY RANGE (hour_ms);
-- Already compressed: Postgres' own TOAST compression would only spend CPU.
ALTER TABLE gpu_samples_packed ALTER COLUMN data SET STORAGE EXTERNAL;
-- One device's chunks of a range; a device-hour may hold several chunks
-- (samples that arrived after their hour was packed).
CREATE INDEX gpu_samples_packed_device_hour ON gpu_samples_packed (device_id, hour_ms);

CREATE TABLE process_samples_packed (
    process_id  BIGINT  NOT NULL,
    hour_ms     BIGINT  NOT NULL,
    first_ts_ms BIGINT  NOT NULL,
    last_ts_ms  BIGINT  NOT NULL,
    samples     INTEGER NOT NULL,
    data        BYTEA   NOT NULL
) PARTITION BY RANGE (hour_ms);
ALTER TABLE process_samples_packed ALTER COLUMN data SET STORAGE EXTERNAL;
CREATE INDEX process_samples_packed_process_hour ON process_samples_packed (process_id, hour_ms);

-- How far each raw table is packed: every day partition that ends at or
-- before packed_until_ms has been (or is being) moved into chunks.
CREATE TABLE pack_progress (
    parent          TEXT   PRIMARY KEY,
    packed_until_ms BIGINT NOT NULL
);
INSERT INTO pack_progress (parent, packed_until_ms) VALUES ('gpu_samples', 0), ('process_samples', 0);

-- While a day is packed over several passes: the series packed so far are
-- those up to last_series, so a pass resumes there instead of walking the
-- index past them again. i64::MAX once the walk reached the end.
CREATE TABLE pack_cursors (
    parent      TEXT   NOT NULL,
    day_ms      BIGINT NOT NULL,
    last_series BIGINT NOT NULL,
    PRIMARY KEY (parent, day_ms)
);
