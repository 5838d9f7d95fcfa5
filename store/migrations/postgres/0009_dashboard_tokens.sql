-- Dashboard and API users get tokens too (viewer or admin), in the same
-- table as the agents' so that one list and one revoke serve both; the role
-- keeps them apart: an agent token opens no dashboard and a viewer token
-- feeds no samples.
ALTER TABLE agent_tokens RENAME TO tokens;
ALTER TABLE tokens ADD COLUMN role TEXT NOT NULL DEFAULT 'agent'
    CHECK (role IN ('agent', 'viewer', 'admin'));
-- Who holds a dashboard token; it is recorded on what they acknowledge or silence.
ALTER TABLE tokens ADD COLUMN name TEXT;
-- A collector of the previous version, still running during a rolling
-- upgrade, reads and enrols agent tokens by the old name meanwhile (a
-- simple view, so its INSERT works too). A later migration drops it.
CREATE VIEW agent_tokens AS
    SELECT id, node, token_sha256, hint, created_at_ms, revoked_at_ms
    FROM tokens WHERE role = 'agent';
