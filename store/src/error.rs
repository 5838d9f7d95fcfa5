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
    /// Stored data that cannot be read back (a damaged packed chunk).
    #[error("stored data is damaged: {0}")]
    Damaged(String),
}
