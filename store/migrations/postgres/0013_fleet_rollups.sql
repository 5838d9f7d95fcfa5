-- The fleet view's history: one row per minute and per hour with the sums
-- over the whole fleet, written by the rollup pass in the transaction that
-- writes the devices' rollups of the same bucket (and again whenever those
-- are redone for late samples). A week's chart of 1,000 GPUs then reads
-- 10,080 rows instead of ten million device rows.
--
-- Sums count physical GPUs only (a MIG instance's memory is part of its
-- parent's); devices_below_10pct counts a physical GPU once when its peak
-- (used_max + reserved) or that of one of its MIG instances reached 90 % of
-- its total. Small tables: not partitioned, expired by DELETE.
CREATE TABLE fleet_1m (
    ts_ms               BIGINT  PRIMARY KEY,
    used_avg            BIGINT  NOT NULL,
    used_max            BIGINT  NOT NULL,
    capacity            BIGINT  NOT NULL,
    devices             INTEGER NOT NULL,
    devices_below_10pct INTEGER NOT NULL
);
CREATE TABLE fleet_1h (LIKE fleet_1m INCLUDING ALL);

-- An upgraded database has its history at once: the rows from the device
-- rollups already there.
INSERT INTO fleet_1m (ts_ms, used_avg, used_max, capacity, devices, devices_below_10pct)
SELECT r.ts_ms,
    COALESCE(SUM(r.used_avg) FILTER (WHERE d.parent_id IS NULL), 0)::int8,
    COALESCE(SUM(r.used_max) FILTER (WHERE d.parent_id IS NULL), 0)::int8,
    COALESCE(SUM(r.total) FILTER (WHERE d.parent_id IS NULL), 0)::int8,
    COUNT(*) FILTER (WHERE d.parent_id IS NULL)::int4,
    COUNT(DISTINCT COALESCE(d.parent_id, d.id))
        FILTER (WHERE r.total > 0 AND (r.used_max + r.reserved) * 10 >= r.total * 9)::int4
FROM gpu_samples_1m r JOIN devices d ON d.id = r.device_id
GROUP BY r.ts_ms;

INSERT INTO fleet_1h (ts_ms, used_avg, used_max, capacity, devices, devices_below_10pct)
SELECT r.ts_ms,
    COALESCE(SUM(r.used_avg) FILTER (WHERE d.parent_id IS NULL), 0)::int8,
    COALESCE(SUM(r.used_max) FILTER (WHERE d.parent_id IS NULL), 0)::int8,
    COALESCE(SUM(r.total) FILTER (WHERE d.parent_id IS NULL), 0)::int8,
    COUNT(*) FILTER (WHERE d.parent_id IS NULL)::int4,
    COUNT(DISTINCT COALESCE(d.parent_id, d.id))
        FILTER (WHERE r.total > 0 AND (r.used_max + r.reserved) * 10 >= r.total * 9)::int4
FROM gpu_samples_1h r JOIN devices d ON d.id = r.device_id
GROUP BY r.ts_ms;
