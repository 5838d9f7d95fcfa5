//! Opening the store a URL names, and keeping passwords out of messages.

use std::sync::Arc;

use crate::rollup::StorageConfig;
use crate::{PostgresStore, SqliteStore, Store, StoreError};

/// Opens the store a URL names, creating and migrating its schema.
pub async fn connect(url: &str) -> Result<Arc<dyn Store>, StoreError> {
    connect_with(url, StorageConfig::default()).await
}

/// [`connect`] with retention other than the defaults.
pub async fn connect_with(url: &str, storage: StorageConfig) -> Result<Arc<dyn Store>, StoreError> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Ok(Arc::new(PostgresStore::connect(url, storage).await?))
    } else if url.starts_with("sqlite:") {
        Ok(Arc::new(SqliteStore::connect(url, storage).await?))
    } else {
        Err(StoreError::UnsupportedUrl(redact_url(url)))
    }
}

/// Drops the password from a database URL before it reaches a message.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let userinfo = &url[scheme_end + 3..at];
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{}://{}:***@{}", &url[..scheme_end], user, &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_reach_messages() {
        assert_eq!(
            redact_url("postgres://headroom:s3cret@db:5432/headroom"),
            "postgres://headroom:***@db:5432/headroom"
        );
        assert_eq!(redact_url("sqlite://data.db"), "sqlite://data.db");
    }
}
