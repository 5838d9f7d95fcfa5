-- Raw GPU samples a day old or more are packed by maintenance into one
-- compressed chunk per device and hour (store/postgres/packed.rs), a few
-- bytes per sample instead of about 140. Partitioned by day like the raw
-- table and dropped with it by retention.
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

-- How far raw GPU samples are packed: every day partition that ends at or
-- before packed_until_ms has been (or is being) moved into chunks.
CREATE TABLE pack_progress (
    parent          TEXT   PRIMARY KEY,
    packed_until_ms BIGINT NOT NULL
);
INSERT INTO pack_progress (parent, packed_until_ms) VALUES ('gpu_samples', 0);
