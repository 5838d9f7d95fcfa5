-- The fleet overview tells a layout change from a mark over the nodes:
-- their count, the sum of their layout_version and the highest id. Read
-- from `nodes`, which every node's batches rewrite each second
-- (last_seen_ms), that mark was the overview's largest step at 12,500
-- nodes. node_layouts holds the same figures in narrow rows written only
-- when a layout changes, so the mark reads a few pages that stay put.
-- Triggers keep it in the transaction that changes `nodes`, whichever
-- collector (of whichever version, in a rolling upgrade) makes the change.
CREATE TABLE node_layouts (
    node_id        BIGINT PRIMARY KEY REFERENCES nodes (id) ON DELETE CASCADE,
    layout_version BIGINT NOT NULL
);
INSERT INTO node_layouts (node_id, layout_version) SELECT id, layout_version FROM nodes;

CREATE FUNCTION headroom_keep_node_layout() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO node_layouts (node_id, layout_version) VALUES (NEW.id, NEW.layout_version)
    ON CONFLICT (node_id) DO UPDATE SET layout_version = EXCLUDED.layout_version;
    RETURN NULL;
END
$$;
CREATE TRIGGER nodes_keep_layout_on_insert AFTER INSERT ON nodes
    FOR EACH ROW EXECUTE FUNCTION headroom_keep_node_layout();
CREATE TRIGGER nodes_keep_layout_on_update AFTER UPDATE OF layout_version ON nodes
    FOR EACH ROW WHEN (OLD.layout_version IS DISTINCT FROM NEW.layout_version)
    EXECUTE FUNCTION headroom_keep_node_layout();
