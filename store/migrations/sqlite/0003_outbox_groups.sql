-- Notifications for the same channel and group (a node) that are due
-- together are delivered as one message.
ALTER TABLE outbox ADD COLUMN group_key TEXT NOT NULL DEFAULT '';
