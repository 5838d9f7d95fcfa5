-- When a device left its node's inventory: a node's devices count against
-- its budget while present or recently absent, and absent ones already on
-- record are counted from the upgrade.
ALTER TABLE devices ADD COLUMN absent_since_ms INTEGER;
UPDATE devices SET absent_since_ms = CAST(strftime('%s', 'now') AS INTEGER) * 1000 WHERE present = 0;
