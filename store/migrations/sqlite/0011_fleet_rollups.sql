-- The fleet view's history: one row per minute and per hour with the sums
-- over the whole fleet, written by the rollup pass in the transaction that
-- writes the devices' rollups of the same bucket. Same tables and meaning
-- as Postgres (migrations/postgres/0013_fleet_rollups.sql): sums over
-- physical GPUs only; devices_below_10pct counts a physical GPU once when it
-- or one of its MIG instances peaked at 90 % of its total or more.
CREATE TABLE fleet_1m (
    ts_ms               INTEGER PRIMARY KEY,
    used_avg            INTEGER NOT NULL,
    used_max            INTEGER NOT NULL,
    capacity            INTEGER NOT NULL,
    devices             INTEGER NOT NULL,
    devices_below_10pct INTEGER NOT NULL
);
CREATE TABLE fleet_1h (
    ts_ms               INTEGER PRIMARY KEY,
    used_avg            INTEGER NOT NULL,
    used_max            INTEGER NOT NULL,
    capacity            INTEGER NOT NULL,
    devices             INTEGER NOT NULL,
    devices_below_10pct INTEGER NOT NULL
);

-- An upgraded database has its history at once.
INSERT INTO fleet_1m (ts_ms, used_avg, used_max, capacity, devices, devices_below_10pct)
SELECT r.ts_ms,
    COALESCE(SUM(CASE WHEN d.parent_id IS NULL THEN r.used_avg END), 0),
    COALESCE(SUM(CASE WHEN d.parent_id IS NULL THEN r.used_max END), 0),
    COALESCE(SUM(CASE WHEN d.parent_id IS NULL THEN r.total END), 0),
    COUNT(CASE WHEN d.parent_id IS NULL THEN 1 END),
    COUNT(DISTINCT CASE WHEN r.total > 0 AND (r.used_max + r.reserved) * 10 >= r.total * 9
        THEN COALESCE(d.parent_id, d.id) END)
FROM gpu_samples_1m r JOIN devices d ON d.id = r.device_id
GROUP BY r.ts_ms;

INSERT INTO fleet_1h (ts_ms, used_avg, used_max, capacity, devices, devices_below_10pct)
SELECT r.ts_ms,
    COALESCE(SUM(CASE WHEN d.parent_id IS NULL THEN r.used_avg END), 0),
    COALESCE(SUM(CASE WHEN d.parent_id IS NULL THEN r.used_max END), 0),
    COALESCE(SUM(CASE WHEN d.parent_id IS NULL THEN r.total END), 0),
    COUNT(CASE WHEN d.parent_id IS NULL THEN 1 END),
    COUNT(DISTINCT CASE WHEN r.total > 0 AND (r.used_max + r.reserved) * 10 >= r.total * 9
        THEN COALESCE(d.parent_id, d.id) END)
FROM gpu_samples_1h r JOIN devices d ON d.id = r.device_id
GROUP BY r.ts_ms;
