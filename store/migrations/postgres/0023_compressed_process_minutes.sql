-- A process's hour of packed minutes (migration 0021) is about 2.6 kB of
-- arrays, and for a steady process they compress to a few hundred bytes.
-- But Postgres compresses a row only until it fits in about 2 kB, largest
-- array first, so such a row was kept at about 1.8 kB with most of its
-- arrays as they were: 0.64 bytes per process-second, more than the
-- process's chunks. Arrays marked MAIN are compressed and kept in the
-- row (moved out of it only past a page), and a toast_tuple_target of 128
-- makes Postgres compress every one of them. (A row under about 2 kB, a
-- process seen for less than about 45 minutes of the hour, is left as it
-- is whatever the target: the target is where compression stops, not
-- where it starts.) toast_tuple_target is a
-- partition's own setting (a partitioned table takes none), so the
-- partition function gives it to each new partition of the table.
--
-- GPU rows keep the defaults: their noisy figures (mean memory, PCIe
-- rates) barely compress, and kept whole in the row they would fit two
-- to a page.
ALTER TABLE process_samples_1m_packed
    ALTER COLUMN minute SET STORAGE MAIN, ALTER COLUMN last_offset_ms SET STORAGE MAIN,
    ALTER COLUMN samples SET STORAGE MAIN, ALTER COLUMN used_min SET STORAGE MAIN,
    ALTER COLUMN used_max SET STORAGE MAIN, ALTER COLUMN used_avg SET STORAGE MAIN,
    ALTER COLUMN used_last SET STORAGE MAIN;

CREATE OR REPLACE FUNCTION headroom_partition_options(parent TEXT) RETURNS TEXT
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE parent WHEN 'process_samples_1m_packed' THEN 'toast_tuple_target = 128' END
$$;

CREATE OR REPLACE FUNCTION headroom_create_partitions(parent TEXT, width_ms BIGINT, from_ms BIGINT, to_ms BIGINT)
RETURNS INTEGER LANGUAGE plpgsql AS $$
DECLARE
    start_ms BIGINT;
    created  INTEGER := 0;
    name     TEXT;
    options  TEXT := headroom_partition_options(parent);
BEGIN
    IF from_ms IS NULL OR to_ms IS NULL THEN
        RETURN 0;
    END IF;
    start_ms := from_ms - ((from_ms % width_ms) + width_ms) % width_ms;
    WHILE start_ms <= to_ms LOOP
        name := parent || '_p' || to_char(to_timestamp(start_ms / 1000) AT TIME ZONE 'UTC', 'YYYYMMDD');
        IF to_regclass(quote_ident(name)) IS NULL THEN
            EXECUTE format('CREATE TABLE %I PARTITION OF %I FOR VALUES FROM (%s) TO (%s)%s',
                           name, parent, start_ms, start_ms + width_ms,
                           COALESCE(' WITH (' || options || ')', ''));
            created := created + 1;
        END IF;
        start_ms := start_ms + width_ms;
    END LOOP;
    RETURN created;
END
$$;

-- Partitions that exist already take the setting for the rows written
-- from now on; rows already there stay as they were stored.
DO $$
DECLARE
    part REGCLASS;
BEGIN
    FOR part IN SELECT inhrelid::regclass FROM pg_inherits
                WHERE inhparent = 'process_samples_1m_packed'::regclass LOOP
        EXECUTE format('ALTER TABLE %s SET (%s)', part,
                       headroom_partition_options('process_samples_1m_packed'));
    END LOOP;
END
$$;
