-- Timestamps are Unix epoch milliseconds (BIGINT) everywhere. Sample tables
-- refer to devices by a small integer id, never by UUID string.

CREATE TABLE nodes (
    id                 INTEGER PRIMARY KEY,
    name               TEXT    NOT NULL UNIQUE,
    boot_id            TEXT    NOT NULL,
    agent_version      TEXT    NOT NULL,
    driver_version     TEXT    NOT NULL,
    sample_interval_ms INTEGER NOT NULL,
    registered_at_ms   BIGINT  NOT NULL,
    last_seen_ms       BIGINT  NOT NULL
);

-- One row per agent boot: the highest batch committed, which makes replays
-- idempotent (a batch is written only if its seq is above this).
CREATE TABLE agent_boots (
    node_id       BIGINT NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    boot_id       TEXT   NOT NULL,
    committed_seq BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (node_id, boot_id)
);

-- GPUs and MIG instances (parent_id set).
CREATE TABLE devices (
    id                      INTEGER PRIMARY KEY,
    uuid                    TEXT    NOT NULL UNIQUE,
    node_id                 BIGINT  NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    parent_id               INTEGER REFERENCES devices (id),
    gpu_index               INTEGER NOT NULL,
    name                    TEXT    NOT NULL,
    memory_total            BIGINT  NOT NULL,
    pcie_generation         INTEGER NOT NULL,
    pcie_width              INTEGER NOT NULL,
    mig_gpu_instance_id     INTEGER,
    mig_compute_instance_id INTEGER,
    mig_profile             TEXT,
    present                 INTEGER NOT NULL DEFAULT 1
);
CREATE INDEX devices_node ON devices (node_id);

CREATE TABLE gpu_samples (
    device_id   INTEGER  NOT NULL,
    ts_ms       BIGINT   NOT NULL,
    interval_ms INTEGER  NOT NULL,
    poll_count  INTEGER  NOT NULL,
    used_last   BIGINT   NOT NULL,
    used_min    BIGINT   NOT NULL,
    used_max    BIGINT   NOT NULL,
    reserved    BIGINT   NOT NULL,
    total       BIGINT   NOT NULL,
    utilization SMALLINT,
    pcie_tx     BIGINT,
    pcie_rx     BIGINT
);
CREATE INDEX gpu_samples_device_ts ON gpu_samples (device_id, ts_ms);

-- The newest sample per device, so the fleet overview never scans samples.
CREATE TABLE gpu_latest (
    device_id   INTEGER PRIMARY KEY,
    ts_ms       BIGINT  NOT NULL,
    used_last   BIGINT  NOT NULL,
    used_min    BIGINT  NOT NULL,
    used_max    BIGINT  NOT NULL,
    reserved    BIGINT  NOT NULL,
    total       BIGINT  NOT NULL,
    utilization SMALLINT,
    pcie_tx     BIGINT,
    pcie_rx     BIGINT
);

-- One row per process incarnation on one device; (pid, start time) survives
-- pid reuse. Holds the process's attribution once, not per sample.
CREATE TABLE processes (
    id            INTEGER PRIMARY KEY,
    device_id     INTEGER NOT NULL,
    pid           BIGINT  NOT NULL,
    start_time_ms BIGINT  NOT NULL,
    name          TEXT    NOT NULL,
    uid           BIGINT  NOT NULL,
    user_name     TEXT    NOT NULL,
    container_id  TEXT    NOT NULL,
    pod_uid       TEXT    NOT NULL,
    slurm_job_id  TEXT    NOT NULL,
    first_seen_ms BIGINT  NOT NULL,
    last_seen_ms  BIGINT  NOT NULL,
    memory_last   BIGINT  NOT NULL,
    memory_peak   BIGINT  NOT NULL,
    UNIQUE (device_id, pid, start_time_ms)
);
CREATE INDEX processes_last_seen ON processes (last_seen_ms);

CREATE TABLE process_samples (
    process_id BIGINT NOT NULL,
    ts_ms      BIGINT NOT NULL,
    used_last  BIGINT NOT NULL,
    used_max   BIGINT NOT NULL
);
CREATE INDEX process_samples_process_ts ON process_samples (process_id, ts_ms);

CREATE TABLE events (
    id        INTEGER PRIMARY KEY,
    node_id   BIGINT  NOT NULL,
    device_id INTEGER,
    ts_ms     BIGINT  NOT NULL,
    kind      TEXT    NOT NULL,
    code      BIGINT  NOT NULL,
    pid       BIGINT  NOT NULL,
    detail    TEXT    NOT NULL
);
CREATE INDEX events_ts ON events (ts_ms);
