-- Storage at fleet scale: every time-series table is range-partitioned on
-- ts_ms, so retention drops whole partitions instead of deleting rows, and
-- GPU and process memory is rolled up per minute and per hour, keeping min,
-- max, average and last so that a peak survives every rollup.
--
-- The collector creates partitions ahead of time (store/postgres/maintenance.rs);
-- this migration only creates those that existing rows need.

CREATE FUNCTION headroom_create_partitions(parent TEXT, width_ms BIGINT, from_ms BIGINT, to_ms BIGINT)
RETURNS INTEGER LANGUAGE plpgsql AS $$
DECLARE
    start_ms BIGINT;
    created  INTEGER := 0;
    name     TEXT;
BEGIN
    IF from_ms IS NULL OR to_ms IS NULL THEN
        RETURN 0;
    END IF;
    start_ms := from_ms - ((from_ms % width_ms) + width_ms) % width_ms;
    WHILE start_ms <= to_ms LOOP
        name := parent || '_p' || to_char(to_timestamp(start_ms / 1000) AT TIME ZONE 'UTC', 'YYYYMMDD');
        IF to_regclass(quote_ident(name)) IS NULL THEN
            EXECUTE format('CREATE TABLE %I PARTITION OF %I FOR VALUES FROM (%s) TO (%s)',
                           name, parent, start_ms, start_ms + width_ms);
            created := created + 1;
        END IF;
        start_ms := start_ms + width_ms;
    END LOOP;
    RETURN created;
END
$$;

-- Raw GPU samples. Columns ordered widest first, so that no row carries
-- alignment padding: a row is 80 bytes of data.
ALTER TABLE gpu_samples RENAME TO gpu_samples_unpartitioned;
DROP INDEX gpu_samples_device_ts;
CREATE TABLE gpu_samples (
    ts_ms       BIGINT   NOT NULL,
    used_last   BIGINT   NOT NULL,
    used_min    BIGINT   NOT NULL,
    used_max    BIGINT   NOT NULL,
    reserved    BIGINT   NOT NULL,
    total       BIGINT   NOT NULL,
    pcie_tx     BIGINT,
    pcie_rx     BIGINT,
    device_id   INTEGER  NOT NULL,
    interval_ms INTEGER  NOT NULL,
    poll_count  INTEGER  NOT NULL,
    utilization SMALLINT
) PARTITION BY RANGE (ts_ms);
-- Charts read one device's range; rollups read every device's minute, which
-- a BRIN index finds in a few pages because rows arrive in time order.
CREATE INDEX gpu_samples_device_ts ON gpu_samples (device_id, ts_ms);
CREATE INDEX gpu_samples_ts ON gpu_samples USING brin (ts_ms);
SELECT headroom_create_partitions('gpu_samples', 86400000,
    (SELECT min(ts_ms) FROM gpu_samples_unpartitioned), (SELECT max(ts_ms) FROM gpu_samples_unpartitioned));
INSERT INTO gpu_samples (ts_ms, used_last, used_min, used_max, reserved, total, pcie_tx, pcie_rx,
    device_id, interval_ms, poll_count, utilization)
SELECT ts_ms, used_last, used_min, used_max, reserved, total, pcie_tx, pcie_rx,
    device_id, interval_ms, poll_count, utilization
FROM gpu_samples_unpartitioned;
DROP TABLE gpu_samples_unpartitioned;

ALTER TABLE process_samples RENAME TO process_samples_unpartitioned;
DROP INDEX process_samples_process_ts;
CREATE TABLE process_samples (
    process_id BIGINT NOT NULL,
    ts_ms      BIGINT NOT NULL,
    used_last  BIGINT NOT NULL,
    used_max   BIGINT NOT NULL
) PARTITION BY RANGE (ts_ms);
CREATE INDEX process_samples_process_ts ON process_samples (process_id, ts_ms);
CREATE INDEX process_samples_ts ON process_samples USING brin (ts_ms);
SELECT headroom_create_partitions('process_samples', 86400000,
    (SELECT min(ts_ms) FROM process_samples_unpartitioned), (SELECT max(ts_ms) FROM process_samples_unpartitioned));
INSERT INTO process_samples SELECT * FROM process_samples_unpartitioned;
DROP TABLE process_samples_unpartitioned;

ALTER TABLE allocator_samples RENAME TO allocator_samples_unpartitioned;
ALTER TABLE allocator_samples_unpartitioned RENAME CONSTRAINT allocator_samples_pkey TO allocator_samples_unpartitioned_pkey;
CREATE TABLE allocator_samples (
    process_id     BIGINT NOT NULL,
    ts_ms          BIGINT NOT NULL,
    allocated      BIGINT NOT NULL,
    reserved       BIGINT NOT NULL,
    active         BIGINT NOT NULL,
    inactive_split BIGINT NOT NULL,
    peak_allocated BIGINT NOT NULL,
    alloc_retries  BIGINT NOT NULL,
    ooms           BIGINT NOT NULL,
    PRIMARY KEY (process_id, ts_ms)
) PARTITION BY RANGE (ts_ms);
SELECT headroom_create_partitions('allocator_samples', 86400000,
    (SELECT min(ts_ms) FROM allocator_samples_unpartitioned), (SELECT max(ts_ms) FROM allocator_samples_unpartitioned));
INSERT INTO allocator_samples SELECT * FROM allocator_samples_unpartitioned;
DROP TABLE allocator_samples_unpartitioned;

-- Events lose their surrogate key (nothing refers to it, and a partitioned
-- table's keys must include ts_ms).
ALTER TABLE events RENAME TO events_unpartitioned;
DROP INDEX events_ts;
DROP INDEX events_device_ts;
CREATE TABLE events (
    ts_ms     BIGINT  NOT NULL,
    node_id   BIGINT  NOT NULL,
    code      BIGINT  NOT NULL,
    pid       BIGINT  NOT NULL,
    device_id INTEGER,
    kind      TEXT    NOT NULL,
    detail    TEXT    NOT NULL
) PARTITION BY RANGE (ts_ms);
CREATE INDEX events_ts ON events (ts_ms);
CREATE INDEX events_device_ts ON events (device_id, ts_ms);
SELECT headroom_create_partitions('events', 86400000,
    (SELECT min(ts_ms) FROM events_unpartitioned), (SELECT max(ts_ms) FROM events_unpartitioned));
INSERT INTO events (ts_ms, node_id, code, pid, device_id, kind, detail)
SELECT ts_ms, node_id, code, pid, device_id, kind, detail FROM events_unpartitioned;
DROP TABLE events_unpartitioned;

-- Rollups. ts_ms is the start of the minute or hour; last_ts_ms the newest
-- raw sample in it. used_avg is the mean of used_last over `samples`
-- samples, so coarser rollups weight it by samples.
CREATE TABLE gpu_samples_1m (
    ts_ms       BIGINT  NOT NULL,
    last_ts_ms  BIGINT  NOT NULL,
    used_min    BIGINT  NOT NULL,
    used_max    BIGINT  NOT NULL,
    used_avg    BIGINT  NOT NULL,
    used_last   BIGINT  NOT NULL,
    reserved    BIGINT  NOT NULL,
    total       BIGINT  NOT NULL,
    pcie_tx     BIGINT,
    pcie_rx     BIGINT,
    device_id   INTEGER NOT NULL,
    samples     INTEGER NOT NULL,
    utilization REAL,
    PRIMARY KEY (device_id, ts_ms)
) PARTITION BY RANGE (ts_ms);
CREATE INDEX gpu_samples_1m_ts ON gpu_samples_1m USING brin (ts_ms);
CREATE TABLE gpu_samples_1h (LIKE gpu_samples_1m INCLUDING ALL) PARTITION BY RANGE (ts_ms);

CREATE TABLE process_samples_1m (
    process_id BIGINT  NOT NULL,
    ts_ms      BIGINT  NOT NULL,
    last_ts_ms BIGINT  NOT NULL,
    used_min   BIGINT  NOT NULL,
    used_max   BIGINT  NOT NULL,
    used_avg   BIGINT  NOT NULL,
    used_last  BIGINT  NOT NULL,
    samples    INTEGER NOT NULL,
    PRIMARY KEY (process_id, ts_ms)
) PARTITION BY RANGE (ts_ms);
CREATE INDEX process_samples_1m_ts ON process_samples_1m USING brin (ts_ms);
CREATE TABLE process_samples_1h (LIKE process_samples_1m INCLUDING ALL) PARTITION BY RANGE (ts_ms);

-- Rolling up: every bucket before done_until_ms has been rolled up at that
-- step, except buckets listed in rollup_pending (late samples, from an
-- agent's spool, land there and are rolled up again).
CREATE TABLE rollup_progress (
    step_ms       BIGINT PRIMARY KEY,
    done_until_ms BIGINT NOT NULL
);
CREATE TABLE rollup_pending (
    step_ms   BIGINT NOT NULL,
    bucket_ms BIGINT NOT NULL,
    PRIMARY KEY (step_ms, bucket_ms)
);
-- Existing samples are rolled up from their first minute on.
INSERT INTO rollup_progress (step_ms, done_until_ms)
SELECT step, start - ((start % step) + step) % step
FROM (VALUES (60000::BIGINT), (3600000::BIGINT)) AS s(step),
     (SELECT COALESCE(LEAST((SELECT min(ts_ms) FROM gpu_samples), (SELECT min(ts_ms) FROM process_samples)),
                      (extract(epoch FROM now()) * 1000)::BIGINT) AS start) AS first;

-- The state tables are rewritten every second per GPU, node and boot: room
-- left on each page lets those updates stay on the page without new index
-- entries (heap-only tuples).
ALTER TABLE gpu_latest SET (fillfactor = 50);
ALTER TABLE nodes SET (fillfactor = 50);
ALTER TABLE agent_boots SET (fillfactor = 50);
ALTER TABLE processes SET (fillfactor = 70);
