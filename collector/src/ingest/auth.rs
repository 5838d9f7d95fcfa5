//! Who may feed the collector. With `[agents] require_token`, every gRPC
//! call carries `authorization: Bearer <token>`, and the token must be
//! enrolled (`headroom-collector token create`), not revoked, and issued for
//! the node the call speaks for (or for any node).
//!
//! Active tokens live in memory, refreshed from the store every few seconds:
//! a check is a hash and a lookup, and a revocation cuts even an open stream
//! within [`REFRESH`]. A peer address that fails [`MAX_FAILURES`] times in
//! [`FAILURE_WINDOW`] is refused without a look at its token until the window
//! ends, so guessing is slow and the log is not flooded.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use rand::Rng;
use sha2::{Digest, Sha256};
use tonic::Status;
use tonic::metadata::MetadataMap;

use crate::metrics::CollectorMetrics;
use crate::store::Store;

/// Every token starts with this, so a leaked one is recognisable (secret
/// scanners) and a wrong value (a password, a path) is told apart.
pub const TOKEN_PREFIX: &str = "hra_";
pub const REFRESH: Duration = Duration::from_secs(10);
/// An unknown token reloads the list at most this often: a token enrolled a
/// moment ago works at once, a flood of bad ones costs one query a second.
const MISS_REFRESH: Duration = Duration::from_secs(1);
pub const FAILURE_WINDOW: Duration = Duration::from_secs(60);
pub const MAX_FAILURES: u32 = 10;
/// Peers remembered at most; past it the oldest windows are forgotten.
const MAX_TRACKED_PEERS: usize = 10_000;

/// A token as handed to the operator once, and what the store keeps of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssuedToken {
    pub token: String,
    pub sha256: String,
    pub hint: String,
}

/// A new random token (256 bits).
pub fn issue_token() -> IssuedToken {
    let bytes: [u8; 32] = rand::rng().random();
    let token = format!(
        "{TOKEN_PREFIX}{}",
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    );
    IssuedToken {
        sha256: token_sha256(&token),
        hint: token[..TOKEN_PREFIX.len() + 8].to_owned(),
        token,
    }
}

/// Tokens are random and long, so a plain SHA-256 is enough: nothing to
/// brute-force, no need for a slow password hash on every call.
pub fn token_sha256(token: &str) -> String {
    Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Who a call was authenticated as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// `None` when tokens are not required.
    token_sha256: Option<String>,
    /// The node the token speaks for; `None` for any node.
    node: Option<String>,
}

#[derive(Debug, Default)]
struct TokenCache {
    /// Token hash → the node it is for (`None`: any node).
    by_hash: HashMap<String, Option<String>>,
    loaded_at: Option<Instant>,
}

#[derive(Debug, Clone, Copy)]
struct FailureWindow {
    started: Instant,
    failures: u32,
}

#[derive(Debug)]
pub struct AgentAuth {
    /// `None`: tokens are not required.
    store: Option<Arc<dyn Store>>,
    cache: RwLock<TokenCache>,
    reload: tokio::sync::Mutex<()>,
    failures: Mutex<HashMap<IpAddr, FailureWindow>>,
    metrics: Arc<CollectorMetrics>,
}

impl AgentAuth {
    pub fn new(store: Arc<dyn Store>, require_token: bool, metrics: Arc<CollectorMetrics>) -> Self {
        Self {
            store: require_token.then_some(store),
            cache: RwLock::default(),
            reload: tokio::sync::Mutex::new(()),
            failures: Mutex::default(),
            metrics,
        }
    }

    /// Checks the call's bearer token.
    pub async fn authenticate(
        &self,
        metadata: &MetadataMap,
        peer: Option<IpAddr>,
    ) -> Result<Caller, Status> {
        let Some(store) = &self.store else {
            return Ok(Caller {
                token_sha256: None,
                node: None,
            });
        };
        let locked_out = peer.and_then(|ip| self.locked_out(ip).map(|wait| (ip, wait)));
        let lockout = |(ip, wait): (IpAddr, Duration)| {
            self.metrics.auth_failure();
            Status::unauthenticated(format!(
                "too many failed attempts from {ip}; retry in {} s",
                wait.as_secs().max(1)
            ))
        };
        let Some(value) = metadata.get("authorization") else {
            return Err(match locked_out {
                Some(lock) => lockout(lock),
                None => self.refuse(peer, "no agent token (`authorization: Bearer …` metadata)"),
            });
        };
        let Some(token) = value.to_str().ok().and_then(|v| v.strip_prefix("Bearer ")) else {
            return Err(match locked_out {
                Some(lock) => lockout(lock),
                None => self.refuse(
                    peer,
                    "malformed authorization metadata (want `Bearer <token>`)",
                ),
            });
        };
        let hash = token_sha256(token.trim());
        // A lockout slows guessing; it must not shut out a valid token that
        // shares the address (a NAT, a node whose users send junk).
        let node = match locked_out {
            Some(lock) => {
                // At most one reload per refresh interval while locked out,
                // so a token enrolled meanwhile still gets in.
                let stale = self.cache_age().is_none_or(|age| age >= REFRESH);
                if self.cached(&hash).is_none() && stale {
                    self.reload(store).await?;
                }
                match self.cached(&hash) {
                    Some(node) => node,
                    None => return Err(lockout(lock)),
                }
            }
            None => match self.lookup(store, &hash).await? {
                Some(node) => node,
                None => return Err(self.refuse(peer, "unknown or revoked agent token")),
            },
        };
        Ok(Caller {
            token_sha256: Some(hash),
            node,
        })
    }

    /// The token's node from the cache alone, without reloading.
    fn cached(&self, hash: &str) -> Option<Option<String>> {
        self.cache
            .read()
            .ok()
            .and_then(|cache| cache.by_hash.get(hash).cloned())
    }

    /// How old the cached token list is; `None` before the first load.
    fn cache_age(&self) -> Option<Duration> {
        self.cache
            .read()
            .ok()
            .and_then(|cache| cache.loaded_at)
            .map(|at| at.elapsed())
    }

    /// Refuses a call that speaks for a node its token is not for.
    pub fn check_node(
        &self,
        caller: &Caller,
        node: &str,
        peer: Option<IpAddr>,
    ) -> Result<(), Status> {
        match &caller.node {
            Some(allowed) if allowed != node => {
                let reason = format!("this agent token is for node {allowed:?}, not {node:?}");
                self.record_failure(peer, &reason);
                Err(Status::permission_denied(reason))
            }
            _ => Ok(()),
        }
    }

    /// Whether the caller's token is still enrolled (an open stream's token
    /// may be revoked under it).
    pub async fn still_valid(&self, caller: &Caller, peer: Option<IpAddr>) -> Result<(), Status> {
        let (Some(store), Some(hash)) = (&self.store, &caller.token_sha256) else {
            return Ok(());
        };
        if self.cache_age().is_none_or(|age| age >= REFRESH) {
            self.reload(store).await?;
        }
        if self.cached(hash).is_some() {
            Ok(())
        } else {
            Err(self.refuse(peer, "agent token revoked"))
        }
    }

    async fn lookup(
        &self,
        store: &Arc<dyn Store>,
        hash: &str,
    ) -> Result<Option<Option<String>>, Status> {
        let found = self.cached(hash);
        let reload = match (&found, self.cache_age()) {
            (_, None) => true,
            (Some(_), Some(age)) => age >= REFRESH,
            (None, Some(age)) => age >= MISS_REFRESH,
        };
        if !reload {
            return Ok(found);
        }
        self.reload(store).await?;
        Ok(self.cached(hash))
    }

    async fn reload(&self, store: &Arc<dyn Store>) -> Result<(), Status> {
        let _one_at_a_time = self.reload.lock().await;
        if self.cache_age().is_some_and(|age| age < MISS_REFRESH) {
            return Ok(());
        }
        let tokens = store.active_agent_tokens().await.map_err(|error| {
            self.metrics.storage_error();
            tracing::error!(%error, "loading agent tokens failed");
            Status::unavailable(format!("storage unavailable: {error}"))
        })?;
        if let Ok(mut cache) = self.cache.write() {
            cache.by_hash = tokens
                .into_iter()
                .map(|t| (t.token_sha256, t.node))
                .collect();
            cache.loaded_at = Some(Instant::now());
        }
        Ok(())
    }

    fn refuse(&self, peer: Option<IpAddr>, reason: &str) -> Status {
        self.record_failure(peer, reason);
        Status::unauthenticated(reason.to_owned())
    }

    fn record_failure(&self, peer: Option<IpAddr>, reason: &str) {
        self.metrics.auth_failure();
        let Some(ip) = peer else {
            tracing::warn!(reason, "refused an agent call");
            return;
        };
        let ip = peer_key(ip);
        let Ok(mut failures) = self.failures.lock() else {
            return;
        };
        let now = Instant::now();
        if failures.len() >= MAX_TRACKED_PEERS && !failures.contains_key(&ip) {
            failures.retain(|_, w| now.duration_since(w.started) < FAILURE_WINDOW);
            if failures.len() >= MAX_TRACKED_PEERS {
                // Full of live windows: log and count, but track no more.
                tracing::warn!(peer = %ip, reason, "refused an agent call");
                return;
            }
        }
        let window = failures.entry(ip).or_insert(FailureWindow {
            started: now,
            failures: 0,
        });
        if now.duration_since(window.started) >= FAILURE_WINDOW {
            *window = FailureWindow {
                started: now,
                failures: 0,
            };
        }
        window.failures += 1;
        if window.failures == MAX_FAILURES {
            tracing::warn!(peer = %ip, reason, failures = MAX_FAILURES, "refused an agent call; locking the peer out for the rest of the minute");
        } else if window.failures < MAX_FAILURES {
            tracing::warn!(peer = %ip, reason, "refused an agent call");
        }
    }

    /// How long `ip` stays locked out, if it is.
    fn locked_out(&self, ip: IpAddr) -> Option<Duration> {
        let failures = self.failures.lock().ok()?;
        let window = failures.get(&peer_key(ip))?;
        let elapsed = window.started.elapsed();
        (window.failures >= MAX_FAILURES && elapsed < FAILURE_WINDOW)
            .then(|| FAILURE_WINDOW - elapsed)
    }
}

/// One IPv6 host holds a whole /64: key its failures by the prefix, so
/// rotating addresses within it neither escapes the lockout nor fills the map.
fn peer_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => {
            let s = v6.segments();
            IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn issued_tokens_are_random_prefixed_and_hashed() {
        let a = issue_token();
        let b = issue_token();
        assert_ne!(a.token, b.token);
        assert!(a.token.starts_with(TOKEN_PREFIX));
        assert_eq!(a.token.len(), TOKEN_PREFIX.len() + 64);
        assert_eq!(a.sha256, token_sha256(&a.token));
        assert!(a.token.starts_with(&a.hint));
        assert!(!a.sha256.contains(&a.token[TOKEN_PREFIX.len()..]));
    }
}
