-- Samples are written as chunks at a flush, a while after their batch is
-- accepted, so each agent stream has two marks: agent_boots.committed_seq,
-- the last batch accepted (events stored, rules run), and durable_seq here,
-- the last whose samples are in committed chunks, which the agent may
-- forget. Until now every accepted batch was durable at once. A table of
-- its own: a flush locks these rows, and batch writes, which lock the
-- agent_boots rows, never wait for a flush.
CREATE TABLE stream_durable (
    node_id     BIGINT NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    boot_id     TEXT   NOT NULL,
    durable_seq BIGINT NOT NULL,
    PRIMARY KEY (node_id, boot_id)
);
INSERT INTO stream_durable (node_id, boot_id, durable_seq)
SELECT node_id, boot_id, committed_seq FROM agent_boots WHERE committed_seq > 0;
