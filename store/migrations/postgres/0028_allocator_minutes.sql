-- An allocator chunk of more than a few minutes (an hour compacted, a
-- spool replayed) keeps its reports folded a minute each beside them, as
-- chart points: a chart of minute-wide buckets or wider reads those, not
-- every report (a week of a process at 1 Hz is 600,000). Allocator
-- reports have no rollup tables. Chunks written before stay without
-- (NULL) and chart from their reports until retention drops them.
ALTER TABLE allocator_samples_packed ADD COLUMN minutes BYTEA;
-- Already compressed where that helps, as the reports are.
ALTER TABLE allocator_samples_packed ALTER COLUMN minutes SET STORAGE EXTERNAL;
