-- Dashboard and API users get tokens too (viewer or admin), in the same
-- table as the agents' so that one list and one revoke serve both; the role
-- keeps them apart: an agent token opens no dashboard and a viewer token
-- feeds no samples.
ALTER TABLE agent_tokens RENAME TO tokens;
ALTER TABLE tokens ADD COLUMN role TEXT NOT NULL DEFAULT 'agent'
    CHECK (role IN ('agent', 'viewer', 'admin'));
-- Who holds a dashboard token; it is recorded on what they acknowledge or silence.
ALTER TABLE tokens ADD COLUMN name TEXT;
