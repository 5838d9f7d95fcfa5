-- Collectors sharing this database read each other's open chunks for
-- charts: a node's newest samples sit in the memory of the collector its
-- agent streams to until a flush. stream_holder is where that collector
-- answers (its [cluster] advertise_url), set when the agent registers
-- there; NULL where none is advertised. The secret, made by the first
-- collector that starts, is what they present to each other.
ALTER TABLE nodes ADD COLUMN stream_holder TEXT;
CREATE TABLE peer_secret (
    id     INT  PRIMARY KEY CHECK (id = 1),
    secret TEXT NOT NULL
);
