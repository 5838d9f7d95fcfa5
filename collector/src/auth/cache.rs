//! The active tokens, in memory and refreshed from the store every few
//! seconds: a check is a hash and a lookup, a token enrolled a moment ago
//! works at once, and a revocation takes effect within [`REFRESH`], on open
//! streams and logged-in browsers alike.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use headroom_store::tokens::TokenRole;
use headroom_store::{Store, StoreError};

pub const REFRESH: Duration = Duration::from_secs(10);
/// An unknown token reloads the list at most this often: a flood of bad
/// ones costs one query a second.
const MISS_REFRESH: Duration = Duration::from_secs(1);

/// What an active token grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub role: TokenRole,
    /// Agent tokens: the node it speaks for; `None` for any node.
    pub node: Option<String>,
    /// Dashboard tokens: who holds it.
    pub name: Option<String>,
}

#[derive(Debug, Default)]
struct Loaded {
    /// Token hash → what it grants.
    by_hash: HashMap<String, Grant>,
    at: Option<Instant>,
}

#[derive(Debug)]
pub struct TokenCache {
    store: Arc<dyn Store>,
    loaded: RwLock<Loaded>,
    reload: tokio::sync::Mutex<()>,
}

impl TokenCache {
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            loaded: RwLock::default(),
            reload: tokio::sync::Mutex::new(()),
        }
    }

    /// What `hash` grants, reloading the list when it is stale (or, for an
    /// unknown hash, at most once a second).
    pub async fn lookup(&self, hash: &str) -> Result<Option<Grant>, StoreError> {
        let found = self.cached(hash);
        let reload = match (&found, self.age()) {
            (_, None) => true,
            (Some(_), Some(age)) => age >= REFRESH,
            (None, Some(age)) => age >= MISS_REFRESH,
        };
        if reload {
            self.reload().await?;
            return Ok(self.cached(hash));
        }
        Ok(found)
    }

    /// What `hash` grants, reloading only when the list is older than
    /// [`REFRESH`], found or not: for a locked-out address, whose guesses
    /// must cost no query, but whose revoked tokens must still stop
    /// working and whose newly enrolled ones start.
    pub async fn lookup_stale_only(&self, hash: &str) -> Result<Option<Grant>, StoreError> {
        if self.age().is_none_or(|age| age >= REFRESH) {
            self.reload().await?;
        }
        Ok(self.cached(hash))
    }

    /// Whether `hash` is still active, reloading only when the list is
    /// older than [`REFRESH`]: the check on every message of an open stream.
    pub async fn still_active(&self, hash: &str) -> Result<bool, StoreError> {
        Ok(self.lookup_stale_only(hash).await?.is_some())
    }

    /// What `hash` grants from memory alone.
    pub fn cached(&self, hash: &str) -> Option<Grant> {
        self.loaded
            .read()
            .ok()
            .and_then(|loaded| loaded.by_hash.get(hash).cloned())
    }

    /// How old the list is; `None` before the first load.
    pub fn age(&self) -> Option<Duration> {
        self.loaded
            .read()
            .ok()
            .and_then(|loaded| loaded.at)
            .map(|at| at.elapsed())
    }

    pub async fn reload(&self) -> Result<(), StoreError> {
        let _one_at_a_time = self.reload.lock().await;
        if self.age().is_some_and(|age| age < MISS_REFRESH) {
            return Ok(());
        }
        let tokens = self.store.active_tokens().await?;
        let by_hash = tokens
            .into_iter()
            .filter_map(|t| match TokenRole::parse(&t.role) {
                Some(role) => Some((
                    t.token_sha256,
                    Grant {
                        role,
                        node: t.node,
                        name: t.name,
                    },
                )),
                None => {
                    tracing::warn!(role = %t.role, "ignoring a token with an unknown role");
                    None
                }
            })
            .collect();
        if let Ok(mut loaded) = self.loaded.write() {
            *loaded = Loaded {
                by_hash,
                at: Some(Instant::now()),
            };
        }
        Ok(())
    }
}
