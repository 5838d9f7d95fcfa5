-- The fleet overview reads which devices exist, on which node and named
-- what, in full only when that changed. A node's layout_version rises in
-- the same transaction as any change to its devices (a registration, a
-- device released), so the overview can tell a change from the nodes alone:
-- their count, the sum of their versions and the highest id.
ALTER TABLE nodes ADD COLUMN layout_version BIGINT NOT NULL DEFAULT 0;
