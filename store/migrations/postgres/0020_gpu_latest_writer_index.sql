-- A collector's fleet overview fetches only the gpu_latest rows that other
-- collectors wrote; with one collector for the fleet that is none, and
-- without an index Postgres still reads all of them (15-25 ms at 100,000
-- GPUs) to find so. A collector rewrites its rows with its own id again,
-- so the index leaves their updates HOT: only a row that moves to another
-- collector touches it.
CREATE INDEX gpu_latest_by_writer ON gpu_latest (writer);
