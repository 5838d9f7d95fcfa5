-- What each job did with its GPUs, written when it ends and kept past
-- sample retention (no retention pass touches this table). One row per job
-- and node per collector that watched it: a node's stream is held by one
-- collector at a time, so rows never contend; the API merges a job's rows.
CREATE TABLE job_reports (
    kind TEXT NOT NULL,
    job_id TEXT NOT NULL,
    node TEXT NOT NULL,
    started_at_ms BIGINT NOT NULL,
    ended_at_ms BIGINT NOT NULL,
    -- JSON: the report's body (docs/job-reports.md).
    report TEXT NOT NULL,
    PRIMARY KEY (kind, job_id, node, started_at_ms)
);
CREATE INDEX job_reports_by_job ON job_reports (job_id);
