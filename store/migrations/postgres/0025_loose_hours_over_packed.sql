-- An hour rolled up again inside a packed day (a spool replayed a day or
-- more late, or a leader older than hour packing during a rolling upgrade)
-- is written loose beside its packed copy. Migration 0024's readers summed
-- both, so the rollup used to unpack the whole fleet's day first: 7.2
-- million rows at 100,000 GPUs with two processes each, for one late
-- sample. Now the loose hour is read in place of its packed copy, and the
-- packing pass folds it into the day's row later, without unpacking it.
CREATE OR REPLACE FUNCTION gpu_hours(from_ms BIGINT, to_ms BIGINT)
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
        AND NOT EXISTS (SELECT 1 FROM gpu_samples_1h r
            WHERE r.device_id = p.device_id AND r.ts_ms = p.day_ms + h.hour * 3600000::int8
                AND r.ts_ms >= from_ms AND r.ts_ms < to_ms)
$$;

CREATE OR REPLACE FUNCTION process_hours(from_ms BIGINT, to_ms BIGINT)
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
        AND NOT EXISTS (SELECT 1 FROM process_samples_1h r
            WHERE r.process_id = p.process_id AND r.ts_ms = p.day_ms + h.hour * 3600000::int8
                AND r.ts_ms >= from_ms AND r.ts_ms < to_ms)
$$;
