-- The GPU page lists one device's events over a time range; without this,
-- that reads every event of the fleet in the range.
CREATE INDEX events_device_ts ON events (device_id, ts_ms);
