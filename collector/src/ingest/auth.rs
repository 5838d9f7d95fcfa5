//! Who may feed the collector. With `[agents] require_token`, every gRPC
//! call carries `authorization: Bearer <token>`, and the token must be an
//! enrolled agent token (`headroom-collector token create --node …`), not
//! revoked, and issued for the node the call speaks for (or for any node).
//!
//! Tokens are checked against [`TokenCache`], so a revocation cuts even an
//! open stream within [`REFRESH`]; failures feed a [`Lockout`] per peer.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tonic::Status;
use tonic::metadata::MetadataMap;

pub use crate::auth::cache::REFRESH;
use crate::auth::cache::{Grant, TokenCache};
use crate::auth::lockout::Lockout;
pub use crate::auth::lockout::{FAILURE_WINDOW, MAX_FAILURES};
use crate::auth::token_sha256;
use crate::ingest::validate::Clipped;
use crate::metrics::CollectorMetrics;
use headroom_store::StoreError;
use headroom_store::tokens::TokenRole;

/// Who a call was authenticated as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// `None` when tokens are not required.
    token_sha256: Option<String>,
    /// The node the token speaks for; `None` for any node.
    node: Option<String>,
}

#[derive(Debug)]
pub struct AgentAuth {
    /// `None`: tokens are not required.
    tokens: Option<Arc<TokenCache>>,
    lockout: Lockout,
    metrics: Arc<CollectorMetrics>,
}

impl AgentAuth {
    /// `tokens`: the active tokens when `[agents] require_token` is on.
    pub fn new(tokens: Option<Arc<TokenCache>>, metrics: Arc<CollectorMetrics>) -> Self {
        Self {
            tokens,
            lockout: Lockout::new("an agent call"),
            metrics,
        }
    }

    /// Checks the call's bearer token.
    pub async fn authenticate(
        &self,
        metadata: &MetadataMap,
        peer: Option<IpAddr>,
    ) -> Result<Caller, Status> {
        let Some(tokens) = &self.tokens else {
            return Ok(Caller {
                token_sha256: None,
                node: None,
            });
        };
        let locked_out = peer.and_then(|ip| self.lockout.locked_out(ip).map(|wait| (ip, wait)));
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
        let grant = match locked_out {
            // At most one reload per refresh interval while locked out, so
            // a token enrolled meanwhile gets in and a revoked one stops.
            Some(lock) => match tokens
                .lookup_stale_only(&hash)
                .await
                .map_err(|e| self.unavailable(&e))?
            {
                Some(grant) => grant,
                None => return Err(lockout(lock)),
            },
            None => match tokens
                .lookup(&hash)
                .await
                .map_err(|e| self.unavailable(&e))?
            {
                Some(grant) => grant,
                None => return Err(self.refuse(peer, "unknown or revoked agent token")),
            },
        };
        match grant {
            Grant {
                role: TokenRole::Agent,
                node,
                ..
            } => Ok(Caller {
                token_sha256: Some(hash),
                node,
            }),
            Grant { role, .. } => Err(self.refuse(
                peer,
                &format!(
                    "this is a dashboard token ({}), not an agent token",
                    role.as_str()
                ),
            )),
        }
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
                let reason = format!(
                    "this agent token is for node {allowed:?}, not {}",
                    Clipped(node)
                );
                self.metrics.auth_failure();
                self.lockout.record_failure(peer, &reason);
                Err(Status::permission_denied(reason))
            }
            _ => Ok(()),
        }
    }

    /// Whether the caller's token is still enrolled (an open stream's token
    /// may be revoked under it).
    pub async fn still_valid(&self, caller: &Caller, peer: Option<IpAddr>) -> Result<(), Status> {
        let (Some(tokens), Some(hash)) = (&self.tokens, &caller.token_sha256) else {
            return Ok(());
        };
        if tokens
            .still_active(hash)
            .await
            .map_err(|e| self.unavailable(&e))?
        {
            Ok(())
        } else {
            Err(self.refuse(peer, "agent token revoked"))
        }
    }

    fn unavailable(&self, error: &StoreError) -> Status {
        self.metrics.storage_error();
        tracing::error!(%error, "loading tokens failed");
        // The detail is for the log, not for a caller not yet let in.
        Status::unavailable("the collector cannot read its token list; see its log")
    }

    fn refuse(&self, peer: Option<IpAddr>, reason: &str) -> Status {
        self.metrics.auth_failure();
        self.lockout.record_failure(peer, reason);
        Status::unauthenticated(reason.to_owned())
    }
}
