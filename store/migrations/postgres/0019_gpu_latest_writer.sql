-- Which collector last wrote each gpu_latest row. A collector's fleet
-- overview lays its own newest samples over the rows anyway, so it need not
-- fetch the rows it wrote itself: with one collector for the fleet that is
-- almost all of them. Each collector takes an id from the sequence when it
-- connects; rows written before this migration have none and are fetched.
ALTER TABLE gpu_latest ADD COLUMN writer BIGINT;
CREATE SEQUENCE gpu_latest_writers;
