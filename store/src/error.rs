//! What a store call can fail with; callers branch on `Invalid` (bad input,
//! nothing stored) and `Damaged` (stored data that cannot be read back).

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error("database migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("unsupported database URL {0:?}: use postgres://… or sqlite://…")]
    UnsupportedUrl(String),
    #[error("refused to store: {0}")]
    Invalid(String),
    /// A registration names a device that another node still lists.
    #[error(
        "device {uuid} belongs to node {owner:?}, whose inventory still lists it; \
         if it really moved, run `headroom-collector release-device {uuid}`"
    )]
    DeviceOwned { uuid: String, owner: String },
    /// A registration would give its node more devices than it may have on record.
    #[error(
        "node {node:?} would have {count} devices on record (present, or absent for less \
         than {forget_after_h} h), above the limit of {limit} ([limits] max_devices_per_node)"
    )]
    TooManyDevices {
        node: String,
        count: usize,
        limit: usize,
        forget_after_h: i64,
    },
    /// Samples waiting for a flush fill their memory twice over: the
    /// database does not take chunks as fast as agents send samples. The
    /// batch is refused for now; its agent keeps it and sends it again.
    #[error(
        "{held_mib} MiB of samples wait to be written, twice [storage] chunk_memory_mib; the database is behind"
    )]
    Backlog { held_mib: usize },
    /// Stored data that cannot be read back (a damaged packed chunk).
    #[error("stored data is damaged: {0}")]
    Damaged(String),
}
