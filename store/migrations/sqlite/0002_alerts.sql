-- Alerts, silences and the notification outbox. An alert row is active while
-- its state is pending or firing; at most one active row per fingerprint.

CREATE TABLE alerts (
    id                 INTEGER PRIMARY KEY,
    fingerprint        TEXT   NOT NULL,
    rule               TEXT   NOT NULL,
    severity           TEXT   NOT NULL,
    state              TEXT   NOT NULL,   -- pending | firing | resolved | withdrawn
    labels             TEXT   NOT NULL,   -- JSON object
    summary            TEXT   NOT NULL,
    details            TEXT   NOT NULL,   -- JSON object
    started_at_ms      BIGINT NOT NULL,
    fired_at_ms        BIGINT,
    resolved_at_ms     BIGINT,
    updated_at_ms      BIGINT NOT NULL,
    acknowledged_by    TEXT,
    acknowledged_at_ms BIGINT
);
CREATE UNIQUE INDEX alerts_active_fingerprint ON alerts (fingerprint) WHERE state IN ('pending', 'firing');
CREATE INDEX alerts_state_updated ON alerts (state, updated_at_ms);

CREATE TABLE silences (
    id            INTEGER PRIMARY KEY,
    matchers      TEXT   NOT NULL,   -- JSON object: label -> exact value
    comment       TEXT   NOT NULL,
    created_by    TEXT   NOT NULL,
    starts_at_ms  BIGINT NOT NULL,
    ends_at_ms    BIGINT NOT NULL
);

-- Written in the same transaction as the alert change it announces, so a
-- restart loses no notification; rows are marked, never deleted, on delivery.
CREATE TABLE outbox (
    id                 INTEGER PRIMARY KEY,
    alert_id           BIGINT  NOT NULL,
    channel            TEXT    NOT NULL,
    idempotency_key    TEXT    NOT NULL UNIQUE,
    payload            TEXT    NOT NULL,
    created_at_ms      BIGINT  NOT NULL,
    next_attempt_at_ms BIGINT  NOT NULL,
    attempts           INTEGER NOT NULL DEFAULT 0,
    delivered_at_ms    BIGINT,
    last_error         TEXT
);
CREATE INDEX outbox_due ON outbox (next_attempt_at_ms) WHERE delivered_at_ms IS NULL;
