-- Hour rollups are kept two years, so at a row per series and hour (about
-- 180 bytes with its tuple header and key) they became, once minute
-- rollups were packed, the largest part of what a GPU holds on disk in the
-- long run. Once a day's hour rollups are final, maintenance moves them
-- into one row per series and day, each figure an array of that day's
-- hours; readers see packed and loose hours alike through gpu_hours() and
-- process_hours(), as minutes through gpu_minutes().
--
-- hour is the hour into the day (0-23), last_offset_ms the newest
-- sample's offset into its hour; an array element is NULL where the
-- hour's figure is.
CREATE TABLE gpu_samples_1h_packed (
    day_ms         BIGINT     NOT NULL,
    device_id      INTEGER    NOT NULL,
    hour           SMALLINT[] NOT NULL,
    last_offset_ms INTEGER[]  NOT NULL,
    samples        INTEGER[]  NOT NULL,
    used_min       BIGINT[]   NOT NULL,
    used_max       BIGINT[]   NOT NULL,
    used_avg       BIGINT[]   NOT NULL,
    used_last      BIGINT[]   NOT NULL,
    reserved       BIGINT[]   NOT NULL,
    total          BIGINT[]   NOT NULL,
    utilization    REAL[]     NOT NULL,
    pcie_tx        BIGINT[]   NOT NULL,
    pcie_rx        BIGINT[]   NOT NULL,
    PRIMARY KEY (device_id, day_ms)
) PARTITION BY RANGE (day_ms);

CREATE TABLE process_samples_1h_packed (
    day_ms         BIGINT     NOT NULL,
    process_id     BIGINT     NOT NULL,
    hour           SMALLINT[] NOT NULL,
    last_offset_ms INTEGER[]  NOT NULL,
    samples        INTEGER[]  NOT NULL,
    used_min       BIGINT[]   NOT NULL,
    used_max       BIGINT[]   NOT NULL,
    used_avg       BIGINT[]   NOT NULL,
    used_last      BIGINT[]   NOT NULL,
    PRIMARY KEY (process_id, day_ms)
) PARTITION BY RANGE (day_ms);

-- The fleet's hours and an hour redone read every series' day: packed rows
-- go in day by day, so a BRIN index on the day finds them in a few pages.
CREATE INDEX gpu_samples_1h_packed_day ON gpu_samples_1h_packed USING brin (day_ms);
CREATE INDEX process_samples_1h_packed_day ON process_samples_1h_packed USING brin (day_ms);

-- A GPU's day of 24 hours is about 2.2 kB of arrays, past the 2 kB at
-- which Postgres compresses a row: every array is then compressed and kept
-- in the row (MAIN, and each partition's toast_tuple_target, as migration
-- 0023 does for a process's minutes). A process's day (1.2 kB) stays under
-- it and is kept as it is: its gain is one row, one line pointer and one
-- index entry where there were 24. Partitions inherit the storage and
-- compression.
ALTER TABLE gpu_samples_1h_packed
    ALTER COLUMN hour SET STORAGE MAIN, ALTER COLUMN last_offset_ms SET STORAGE MAIN,
    ALTER COLUMN samples SET STORAGE MAIN, ALTER COLUMN used_min SET STORAGE MAIN,
    ALTER COLUMN used_max SET STORAGE MAIN, ALTER COLUMN used_avg SET STORAGE MAIN,
    ALTER COLUMN used_last SET STORAGE MAIN, ALTER COLUMN reserved SET STORAGE MAIN,
    ALTER COLUMN total SET STORAGE MAIN, ALTER COLUMN utilization SET STORAGE MAIN,
    ALTER COLUMN pcie_tx SET STORAGE MAIN, ALTER COLUMN pcie_rx SET STORAGE MAIN;
ALTER TABLE process_samples_1h_packed
    ALTER COLUMN hour SET STORAGE MAIN, ALTER COLUMN last_offset_ms SET STORAGE MAIN,
    ALTER COLUMN samples SET STORAGE MAIN, ALTER COLUMN used_min SET STORAGE MAIN,
    ALTER COLUMN used_max SET STORAGE MAIN, ALTER COLUMN used_avg SET STORAGE MAIN,
    ALTER COLUMN used_last SET STORAGE MAIN;
DO $$
BEGIN
    EXECUTE 'ALTER TABLE gpu_samples_1h_packed
        ALTER COLUMN hour SET COMPRESSION lz4,
        ALTER COLUMN last_offset_ms SET COMPRESSION lz4, ALTER COLUMN samples SET COMPRESSION lz4,
        ALTER COLUMN used_min SET COMPRESSION lz4, ALTER COLUMN used_max SET COMPRESSION lz4,
        ALTER COLUMN used_avg SET COMPRESSION lz4, ALTER COLUMN used_last SET COMPRESSION lz4,
        ALTER COLUMN reserved SET COMPRESSION lz4, ALTER COLUMN total SET COMPRESSION lz4,
        ALTER COLUMN utilization SET COMPRESSION lz4, ALTER COLUMN pcie_tx SET COMPRESSION lz4,
        ALTER COLUMN pcie_rx SET COMPRESSION lz4';
    EXECUTE 'ALTER TABLE process_samples_1h_packed
        ALTER COLUMN hour SET COMPRESSION lz4,
        ALTER COLUMN last_offset_ms SET COMPRESSION lz4, ALTER COLUMN samples SET COMPRESSION lz4,
        ALTER COLUMN used_min SET COMPRESSION lz4, ALTER COLUMN used_max SET COMPRESSION lz4,
        ALTER COLUMN used_avg SET COMPRESSION lz4, ALTER COLUMN used_last SET COMPRESSION lz4';
EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN
    RAISE NOTICE 'lz4 is not available; packed hour rollups use pglz';
END
$$;

CREATE OR REPLACE FUNCTION headroom_partition_options(parent TEXT) RETURNS TEXT
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN parent IN ('process_samples_1m_packed', 'gpu_samples_1h_packed',
                                'process_samples_1h_packed')
                THEN 'toast_tuple_target = 128' END
$$;

-- Days whose hour rollups were written since they were last packed:
-- triggers mark them in the transaction that writes the hours, whichever
-- collector (of whichever version, in a rolling upgrade) writes them, and
-- the packing pass unmarks a day once none of its hours is loose. Every
-- day that hour rollups already cover is marked here, from the
-- partitions' bounds rather than a scan of two years of rows; a day
-- without rows is unmarked by the first pass.
CREATE TABLE hour_packing_pending (
    day_ms BIGINT PRIMARY KEY
);

CREATE FUNCTION headroom_mark_hour_days() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO hour_packing_pending (day_ms)
    SELECT DISTINCT ts_ms - ts_ms % 86400000 FROM written
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$$;
-- A transition table takes one event a trigger; an upsert fires both.
CREATE TRIGGER gpu_hours_inserted AFTER INSERT ON gpu_samples_1h
    REFERENCING NEW TABLE AS written FOR EACH STATEMENT EXECUTE FUNCTION headroom_mark_hour_days();
CREATE TRIGGER gpu_hours_updated AFTER UPDATE ON gpu_samples_1h
    REFERENCING NEW TABLE AS written FOR EACH STATEMENT EXECUTE FUNCTION headroom_mark_hour_days();
CREATE TRIGGER process_hours_inserted AFTER INSERT ON process_samples_1h
    REFERENCING NEW TABLE AS written FOR EACH STATEMENT EXECUTE FUNCTION headroom_mark_hour_days();
CREATE TRIGGER process_hours_updated AFTER UPDATE ON process_samples_1h
    REFERENCING NEW TABLE AS written FOR EACH STATEMENT EXECUTE FUNCTION headroom_mark_hour_days();
INSERT INTO hour_packing_pending (day_ms)
SELECT DISTINCT day FROM (
    SELECT substring(pg_get_expr(c.relpartbound, c.oid) FROM 'FROM \(''(-?\d+)''\)')::int8 AS lower,
           substring(pg_get_expr(c.relpartbound, c.oid) FROM 'TO \(''(-?\d+)''\)')::int8 AS upper
    FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
    WHERE i.inhparent IN ('gpu_samples_1h'::regclass, 'process_samples_1h'::regclass)
) AS bounds, LATERAL generate_series(lower - lower % 86400000, upper - 1, 86400000) AS day
WHERE lower IS NOT NULL;

-- Every GPU hour rollup in [from_ms, to_ms), loose or packed. Plain SQL,
-- so the planner inlines it and a caller's filter on device_id reaches
-- both tables' keys.
CREATE FUNCTION gpu_hours(from_ms BIGINT, to_ms BIGINT)
RETURNS TABLE (device_id INTEGER, ts_ms BIGINT, last_ts_ms BIGINT, samples INTEGER,
               used_min BIGINT, used_max BIGINT, used_avg BIGINT, used_last BIGINT,
               reserved BIGINT, total BIGINT, utilization REAL, pcie_tx BIGINT, pcie_rx BIGINT)
LANGUAGE sql STABLE AS $$
    SELECT r.device_id, r.ts_ms, r.last_ts_ms, r.samples, r.used_min, r.used_max, r.used_avg,
        r.used_last, r.reserved, r.total, r.utilization, r.pcie_tx, r.pcie_rx
    FROM gpu_samples_1h r WHERE r.ts_ms >= from_ms AND r.ts_ms < to_ms
    UNION ALL
    SELECT p.device_id, p.day_ms + h.hour * 3600000::int8,
        p.day_ms + h.hour * 3600000::int8 + h.last_offset_ms,
        h.samples, h.used_min, h.used_max, h.used_avg, h.used_last, h.reserved, h.total,
        h.utilization, h.pcie_tx, h.pcie_rx
    FROM gpu_samples_1h_packed p,
        LATERAL unnest(p.hour, p.last_offset_ms, p.samples, p.used_min, p.used_max, p.used_avg,
            p.used_last, p.reserved, p.total, p.utilization, p.pcie_tx, p.pcie_rx)
            AS h(hour, last_offset_ms, samples, used_min, used_max, used_avg, used_last, reserved,
                 total, utilization, pcie_tx, pcie_rx)
    WHERE p.day_ms > from_ms - 86400000 AND p.day_ms < to_ms
        AND p.day_ms + h.hour * 3600000::int8 >= from_ms AND p.day_ms + h.hour * 3600000::int8 < to_ms
$$;

CREATE FUNCTION process_hours(from_ms BIGINT, to_ms BIGINT)
RETURNS TABLE (process_id BIGINT, ts_ms BIGINT, last_ts_ms BIGINT, samples INTEGER,
               used_min BIGINT, used_max BIGINT, used_avg BIGINT, used_last BIGINT)
LANGUAGE sql STABLE AS $$
    SELECT r.process_id, r.ts_ms, r.last_ts_ms, r.samples, r.used_min, r.used_max, r.used_avg,
        r.used_last
    FROM process_samples_1h r WHERE r.ts_ms >= from_ms AND r.ts_ms < to_ms
    UNION ALL
    SELECT p.process_id, p.day_ms + h.hour * 3600000::int8,
        p.day_ms + h.hour * 3600000::int8 + h.last_offset_ms,
        h.samples, h.used_min, h.used_max, h.used_avg, h.used_last
    FROM process_samples_1h_packed p,
        LATERAL unnest(p.hour, p.last_offset_ms, p.samples, p.used_min, p.used_max, p.used_avg,
            p.used_last)
            AS h(hour, last_offset_ms, samples, used_min, used_max, used_avg, used_last)
    WHERE p.day_ms > from_ms - 86400000 AND p.day_ms < to_ms
        AND p.day_ms + h.hour * 3600000::int8 >= from_ms AND p.day_ms + h.hour * 3600000::int8 < to_ms
$$;
