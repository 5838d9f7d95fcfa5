-- Late-sample marks may repeat. A writer inserting a mark used to check the
-- primary key, and so waited for any rollup transaction that had taken (and
-- was deleting) the same mark: every writer stalled for the length of a
-- minute's rollup while agents replayed old samples. Without the key a mark
-- is a plain insert that waits for nothing; the rollup job takes every copy
-- of a bucket it rolls up, and copies committed after it looked stay for its
-- next pass.
ALTER TABLE rollup_pending DROP CONSTRAINT rollup_pending_pkey;
CREATE INDEX rollup_pending_step_bucket ON rollup_pending (step_ms, bucket_ms);
