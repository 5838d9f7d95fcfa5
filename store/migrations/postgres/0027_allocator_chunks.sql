-- Allocator reports (a PyTorch job's allocator figures, sent each second by
-- clients/python) written as compressed chunks at a flush of the open
-- chunks, with the job's memory samples, instead of a row per report: a
-- row was about 150 bytes a report, the largest part of what a database
-- of a fleet whose jobs report grew by (bench/database_growth.py). Rows
-- written before this release stay in allocator_samples, chart beside the
-- chunks and expire with raw retention; a collector with
-- `sample_writes = "rows"` still writes rows.
CREATE TABLE allocator_samples_packed (
    process_id  BIGINT  NOT NULL,
    hour_ms     BIGINT  NOT NULL,
    first_ts_ms BIGINT  NOT NULL,
    last_ts_ms  BIGINT  NOT NULL,
    samples     INTEGER NOT NULL,
    data        BYTEA   NOT NULL
) PARTITION BY RANGE (hour_ms);
-- Already compressed: Postgres' own TOAST compression would only spend CPU.
ALTER TABLE allocator_samples_packed ALTER COLUMN data SET STORAGE EXTERNAL;
CREATE INDEX allocator_samples_packed_process_hour ON allocator_samples_packed (process_id, hour_ms);
-- Compaction finds an hour's series by it.
CREATE INDEX allocator_samples_packed_hour ON allocator_samples_packed USING brin (hour_ms);
