-- Minute rollups are kept 90 days, far longer than raw samples, so a row
-- per series and minute (about 176 bytes with its tuple header and key)
-- was most of what a GPU costs on disk in the long run. Once an hour's
-- rollups are final, maintenance moves them into one row per series and
-- hour, each figure an array of that hour's minutes: Postgres compresses
-- such a row as a whole (lz4 where the server has it), and SQL still
-- reads it, so the hour, fleet and chart queries read packed and loose
-- minutes alike through gpu_minutes() and process_minutes().
--
-- minute is the minute into the hour (0-59), last_offset_ms the newest
-- sample's offset into its minute; an array element is NULL where the
-- minute's figure is.
CREATE TABLE gpu_samples_1m_packed (
    hour_ms        BIGINT     NOT NULL,
    device_id      INTEGER    NOT NULL,
    minute         SMALLINT[] NOT NULL,
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
    PRIMARY KEY (device_id, hour_ms)
) PARTITION BY RANGE (hour_ms);

CREATE TABLE process_samples_1m_packed (
    hour_ms        BIGINT     NOT NULL,
    process_id     BIGINT     NOT NULL,
    minute         SMALLINT[] NOT NULL,
    last_offset_ms INTEGER[]  NOT NULL,
    samples        INTEGER[]  NOT NULL,
    used_min       BIGINT[]   NOT NULL,
    used_max       BIGINT[]   NOT NULL,
    used_avg       BIGINT[]   NOT NULL,
    used_last      BIGINT[]   NOT NULL,
    PRIMARY KEY (process_id, hour_ms)
) PARTITION BY RANGE (hour_ms);

-- The fleet rollups read every series' minutes of a range: packed rows go
-- in hour by hour, so a BRIN index on the hour finds them in a few pages.
CREATE INDEX gpu_samples_1m_packed_hour ON gpu_samples_1m_packed USING brin (hour_ms);
CREATE INDEX process_samples_1m_packed_hour ON process_samples_1m_packed USING brin (hour_ms);

-- lz4 takes these rows to about 0.86 of pglz's size; a server built
-- without it keeps pglz. Partitions inherit the setting.
DO $$
BEGIN
    EXECUTE 'ALTER TABLE gpu_samples_1m_packed
        ALTER COLUMN last_offset_ms SET COMPRESSION lz4, ALTER COLUMN samples SET COMPRESSION lz4,
        ALTER COLUMN used_min SET COMPRESSION lz4, ALTER COLUMN used_max SET COMPRESSION lz4,
        ALTER COLUMN used_avg SET COMPRESSION lz4, ALTER COLUMN used_last SET COMPRESSION lz4,
        ALTER COLUMN reserved SET COMPRESSION lz4, ALTER COLUMN total SET COMPRESSION lz4,
        ALTER COLUMN utilization SET COMPRESSION lz4, ALTER COLUMN pcie_tx SET COMPRESSION lz4,
        ALTER COLUMN pcie_rx SET COMPRESSION lz4';
    EXECUTE 'ALTER TABLE process_samples_1m_packed
        ALTER COLUMN last_offset_ms SET COMPRESSION lz4, ALTER COLUMN samples SET COMPRESSION lz4,
        ALTER COLUMN used_min SET COMPRESSION lz4, ALTER COLUMN used_max SET COMPRESSION lz4,
        ALTER COLUMN used_avg SET COMPRESSION lz4, ALTER COLUMN used_last SET COMPRESSION lz4';
EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN
    RAISE NOTICE 'lz4 is not available; packed minute rollups use pglz';
END
$$;

-- Every GPU minute rollup in [from_ms, to_ms), loose or packed. Plain SQL,
-- so the planner inlines it and a caller's filter on device_id reaches
-- both tables' keys.
CREATE FUNCTION gpu_minutes(from_ms BIGINT, to_ms BIGINT)
RETURNS TABLE (device_id INTEGER, ts_ms BIGINT, last_ts_ms BIGINT, samples INTEGER,
               used_min BIGINT, used_max BIGINT, used_avg BIGINT, used_last BIGINT,
               reserved BIGINT, total BIGINT, utilization REAL, pcie_tx BIGINT, pcie_rx BIGINT)
LANGUAGE sql STABLE AS $$
    SELECT r.device_id, r.ts_ms, r.last_ts_ms, r.samples, r.used_min, r.used_max, r.used_avg,
        r.used_last, r.reserved, r.total, r.utilization, r.pcie_tx, r.pcie_rx
    FROM gpu_samples_1m r WHERE r.ts_ms >= from_ms AND r.ts_ms < to_ms
    UNION ALL
    SELECT p.device_id, p.hour_ms + m.minute * 60000, p.hour_ms + m.minute * 60000 + m.last_offset_ms,
        m.samples, m.used_min, m.used_max, m.used_avg, m.used_last, m.reserved, m.total,
        m.utilization, m.pcie_tx, m.pcie_rx
    FROM gpu_samples_1m_packed p,
        LATERAL unnest(p.minute, p.last_offset_ms, p.samples, p.used_min, p.used_max, p.used_avg,
            p.used_last, p.reserved, p.total, p.utilization, p.pcie_tx, p.pcie_rx)
            AS m(minute, last_offset_ms, samples, used_min, used_max, used_avg, used_last, reserved,
                 total, utilization, pcie_tx, pcie_rx)
    WHERE p.hour_ms > from_ms - 3600000 AND p.hour_ms < to_ms
        AND p.hour_ms + m.minute * 60000 >= from_ms AND p.hour_ms + m.minute * 60000 < to_ms
$$;

CREATE FUNCTION process_minutes(from_ms BIGINT, to_ms BIGINT)
RETURNS TABLE (process_id BIGINT, ts_ms BIGINT, last_ts_ms BIGINT, samples INTEGER,
               used_min BIGINT, used_max BIGINT, used_avg BIGINT, used_last BIGINT)
LANGUAGE sql STABLE AS $$
    SELECT r.process_id, r.ts_ms, r.last_ts_ms, r.samples, r.used_min, r.used_max, r.used_avg,
        r.used_last
    FROM process_samples_1m r WHERE r.ts_ms >= from_ms AND r.ts_ms < to_ms
    UNION ALL
    SELECT p.process_id, p.hour_ms + m.minute * 60000, p.hour_ms + m.minute * 60000 + m.last_offset_ms,
        m.samples, m.used_min, m.used_max, m.used_avg, m.used_last
    FROM process_samples_1m_packed p,
        LATERAL unnest(p.minute, p.last_offset_ms, p.samples, p.used_min, p.used_max, p.used_avg,
            p.used_last)
            AS m(minute, last_offset_ms, samples, used_min, used_max, used_avg, used_last)
    WHERE p.hour_ms > from_ms - 3600000 AND p.hour_ms < to_ms
        AND p.hour_ms + m.minute * 60000 >= from_ms AND p.hour_ms + m.minute * 60000 < to_ms
$$;
