-- Bearer tokens agents present on every gRPC call. Only a SHA-256 of each
-- token is kept: a copy of the database lets nobody in.
CREATE TABLE agent_tokens (
    id            INTEGER PRIMARY KEY,
    node          TEXT,               -- NULL: valid for any node name
    token_sha256  TEXT   NOT NULL UNIQUE,
    hint          TEXT   NOT NULL,    -- the token's first characters, to tell tokens apart
    created_at_ms BIGINT NOT NULL,
    revoked_at_ms BIGINT
);
