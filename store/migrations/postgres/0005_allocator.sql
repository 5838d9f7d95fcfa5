-- What a process's own allocator says about its memory (PyTorch's caching
-- allocator, reported through clients/python and the agent's socket): live
-- tensors vs what the allocator holds, fragmentation, retries, OOMs. A table
-- of its own, since most processes never report; one row per report (the
-- process's snapshot time), however many intervals it was joined to.
CREATE TABLE allocator_samples (
    process_id     BIGINT NOT NULL,
    ts_ms          BIGINT NOT NULL,
    allocated      BIGINT NOT NULL,
    reserved       BIGINT NOT NULL,
    active         BIGINT NOT NULL,
    inactive_split BIGINT NOT NULL,
    peak_allocated BIGINT NOT NULL,
    alloc_retries  BIGINT NOT NULL,
    ooms           BIGINT NOT NULL,
    PRIMARY KEY (process_id, ts_ms)
);

-- The newest report per process, for process lists without a scan.
ALTER TABLE processes ADD COLUMN alloc_ts_ms BIGINT;
ALTER TABLE processes ADD COLUMN alloc_allocated BIGINT;
ALTER TABLE processes ADD COLUMN alloc_reserved BIGINT;
ALTER TABLE processes ADD COLUMN alloc_inactive_split BIGINT;
ALTER TABLE processes ADD COLUMN alloc_peak_allocated BIGINT;
ALTER TABLE processes ADD COLUMN alloc_retries BIGINT;
ALTER TABLE processes ADD COLUMN alloc_ooms BIGINT;

-- What the owner of the job can do about an alert, matched to its signal.
ALTER TABLE alerts ADD COLUMN remedy TEXT NOT NULL DEFAULT '';
