//! Bearer tokens, shared by the gRPC side (agents) and the HTTP side
//! (dashboard and API users): how they are made and hashed, the in-memory
//! list of active ones, and the lockout that slows guessing.

pub mod cache;
pub mod lockout;

use rand::Rng;
use sha2::{Digest, Sha256};

use headroom_store::tokens::TokenRole;

/// Every token starts with a prefix naming its kind, so a leaked one is
/// recognisable (secret scanners) and a token pasted in the wrong place (an
/// agent token into the dashboard's login) gets a clear answer.
pub const AGENT_TOKEN_PREFIX: &str = "hra_";
pub const DASHBOARD_TOKEN_PREFIX: &str = "hrd_";

/// A token as handed to the operator once, and what the store keeps of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssuedToken {
    pub token: String,
    pub sha256: String,
    pub hint: String,
}

/// A new random token (256 bits) for `role`.
pub fn issue_token(role: TokenRole) -> IssuedToken {
    let prefix = match role {
        TokenRole::Agent => AGENT_TOKEN_PREFIX,
        TokenRole::Viewer | TokenRole::Admin => DASHBOARD_TOKEN_PREFIX,
    };
    let bytes: [u8; 32] = rand::rng().random();
    let token = format!(
        "{prefix}{}",
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    );
    IssuedToken {
        sha256: token_sha256(&token),
        hint: token[..prefix.len() + 8].to_owned(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_tokens_are_random_prefixed_by_kind_and_hashed() {
        let a = issue_token(TokenRole::Agent);
        let b = issue_token(TokenRole::Agent);
        assert_ne!(a.token, b.token);
        assert!(a.token.starts_with(AGENT_TOKEN_PREFIX));
        assert_eq!(a.token.len(), AGENT_TOKEN_PREFIX.len() + 64);
        assert_eq!(a.sha256, token_sha256(&a.token));
        assert!(a.token.starts_with(&a.hint));
        assert!(!a.sha256.contains(&a.token[AGENT_TOKEN_PREFIX.len()..]));
        for role in [TokenRole::Viewer, TokenRole::Admin] {
            assert!(issue_token(role).token.starts_with(DASHBOARD_TOKEN_PREFIX));
        }
    }
}
