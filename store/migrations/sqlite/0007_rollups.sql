-- Rollups per minute and per hour, keeping min, max, average and last so a
-- peak survives every rollup; same tables and semantics as Postgres
-- (migrations/postgres/0007_partitions_rollups.sql). SQLite has no
-- partitions: retention deletes by time range, which these indexes serve.
CREATE INDEX gpu_samples_ts ON gpu_samples (ts_ms);
CREATE INDEX process_samples_ts ON process_samples (ts_ms);
CREATE INDEX allocator_samples_ts ON allocator_samples (ts_ms);

CREATE TABLE gpu_samples_1m (
    device_id   INTEGER NOT NULL,
    ts_ms       INTEGER NOT NULL,
    last_ts_ms  INTEGER NOT NULL,
    samples     INTEGER NOT NULL,
    used_min    INTEGER NOT NULL,
    used_max    INTEGER NOT NULL,
    used_avg    INTEGER NOT NULL,
    used_last   INTEGER NOT NULL,
    reserved    INTEGER NOT NULL,
    total       INTEGER NOT NULL,
    utilization REAL,
    pcie_tx     INTEGER,
    pcie_rx     INTEGER,
    PRIMARY KEY (device_id, ts_ms)
) WITHOUT ROWID;
CREATE INDEX gpu_samples_1m_ts ON gpu_samples_1m (ts_ms);

CREATE TABLE gpu_samples_1h (
    device_id   INTEGER NOT NULL,
    ts_ms       INTEGER NOT NULL,
    last_ts_ms  INTEGER NOT NULL,
    samples     INTEGER NOT NULL,
    used_min    INTEGER NOT NULL,
    used_max    INTEGER NOT NULL,
    used_avg    INTEGER NOT NULL,
    used_last   INTEGER NOT NULL,
    reserved    INTEGER NOT NULL,
    total       INTEGER NOT NULL,
    utilization REAL,
    pcie_tx     INTEGER,
    pcie_rx     INTEGER,
    PRIMARY KEY (device_id, ts_ms)
) WITHOUT ROWID;
CREATE INDEX gpu_samples_1h_ts ON gpu_samples_1h (ts_ms);

CREATE TABLE process_samples_1m (
    process_id INTEGER NOT NULL,
    ts_ms      INTEGER NOT NULL,
    last_ts_ms INTEGER NOT NULL,
    samples    INTEGER NOT NULL,
    used_min   INTEGER NOT NULL,
    used_max   INTEGER NOT NULL,
    used_avg   INTEGER NOT NULL,
    used_last  INTEGER NOT NULL,
    PRIMARY KEY (process_id, ts_ms)
) WITHOUT ROWID;
CREATE INDEX process_samples_1m_ts ON process_samples_1m (ts_ms);

CREATE TABLE process_samples_1h (
    process_id INTEGER NOT NULL,
    ts_ms      INTEGER NOT NULL,
    last_ts_ms INTEGER NOT NULL,
    samples    INTEGER NOT NULL,
    used_min   INTEGER NOT NULL,
    used_max   INTEGER NOT NULL,
    used_avg   INTEGER NOT NULL,
    used_last  INTEGER NOT NULL,
    PRIMARY KEY (process_id, ts_ms)
) WITHOUT ROWID;
CREATE INDEX process_samples_1h_ts ON process_samples_1h (ts_ms);

CREATE TABLE rollup_progress (
    step_ms       INTEGER PRIMARY KEY,
    done_until_ms INTEGER NOT NULL
);
CREATE TABLE rollup_pending (
    step_ms   INTEGER NOT NULL,
    bucket_ms INTEGER NOT NULL,
    PRIMARY KEY (step_ms, bucket_ms)
) WITHOUT ROWID;
INSERT INTO rollup_progress (step_ms, done_until_ms)
SELECT step, start - (start % step)
FROM (SELECT 60000 AS step UNION ALL SELECT 3600000),
     (SELECT COALESCE(MIN((SELECT MIN(ts_ms) FROM gpu_samples), (SELECT MIN(ts_ms) FROM process_samples)),
                      (SELECT MIN(ts_ms) FROM gpu_samples), (SELECT MIN(ts_ms) FROM process_samples),
                      CAST(unixepoch('now') AS INTEGER) * 1000) AS start);
