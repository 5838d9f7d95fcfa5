-- Samples written as compressed chunks (store/src/chunk_format.rs) at a
-- flush of the collector's open chunks, a row per series and flush, instead
-- of a row per sample: the design Postgres has had since its 0015.
--
-- Each agent stream now has two marks: committed_seq, the last batch
-- accepted (events stored, rules run), and durable_seq, the last whose
-- samples are in committed chunks, which the agent may forget. Until now
-- every accepted batch was durable at once.
ALTER TABLE agent_boots ADD COLUMN durable_seq BIGINT NOT NULL DEFAULT 0;
UPDATE agent_boots SET durable_seq = committed_seq;

-- Rows written before this release stay in gpu_samples and process_samples,
-- chart beside the chunks and expire with raw retention.
CREATE TABLE gpu_samples_packed (
    device_id   INTEGER NOT NULL,
    hour_ms     BIGINT  NOT NULL,
    first_ts_ms BIGINT  NOT NULL,
    last_ts_ms  BIGINT  NOT NULL,
    samples     INTEGER NOT NULL,
    data        BLOB    NOT NULL
);
-- A device-hour holds a chunk per flush until compaction folds them.
CREATE INDEX gpu_samples_packed_device_hour ON gpu_samples_packed (device_id, hour_ms);
CREATE INDEX gpu_samples_packed_hour ON gpu_samples_packed (hour_ms);

CREATE TABLE process_samples_packed (
    process_id  BIGINT  NOT NULL,
    hour_ms     BIGINT  NOT NULL,
    first_ts_ms BIGINT  NOT NULL,
    last_ts_ms  BIGINT  NOT NULL,
    samples     INTEGER NOT NULL,
    data        BLOB    NOT NULL
);
CREATE INDEX process_samples_packed_process_hour ON process_samples_packed (process_id, hour_ms);
CREATE INDEX process_samples_packed_hour ON process_samples_packed (hour_ms);

-- Hours a flush wrote chunks for: once closed, maintenance rewrites each
-- series' chunks of the hour as one.
CREATE TABLE compact_pending (
    hour_ms BIGINT PRIMARY KEY
);
