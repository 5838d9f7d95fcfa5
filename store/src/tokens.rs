//! Bearer tokens: enrolled and revoked by an operator (`headroom-collector
//! token`). Agents present theirs on every gRPC call; dashboard and API
//! users present theirs over HTTP. The store keeps a SHA-256 of each token,
//! never the token.

use async_trait::async_trait;
use serde::Serialize;

use super::StoreError;

/// What a token lets its holder do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenRole {
    /// Sends samples over gRPC, for one node or any; opens no dashboard.
    Agent,
    /// Reads the dashboard and the API.
    Viewer,
    /// Reads, and also acknowledges alerts and creates or expires silences.
    Admin,
}

impl TokenRole {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Agent => "agent",
            Self::Viewer => "viewer",
            Self::Admin => "admin",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "agent" => Some(Self::Agent),
            "viewer" => Some(Self::Viewer),
            "admin" => Some(Self::Admin),
            _ => None,
        }
    }
}

/// A token to enrol, as its hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NewToken<'a> {
    pub role: TokenRole,
    /// Agent tokens: the node it speaks for; `None` for any node.
    pub node: Option<&'a str>,
    /// Dashboard tokens: who holds it.
    pub name: Option<&'a str>,
    pub token_sha256: &'a str,
    /// The token's first characters, to tell tokens apart in a list.
    pub hint: &'a str,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct TokenView {
    pub id: i64,
    /// `agent`, `viewer` or `admin`.
    pub role: String,
    /// Agent tokens: `None` when valid for any node name.
    pub node: Option<String>,
    pub name: Option<String>,
    pub hint: String,
    pub created_at_ms: i64,
    pub revoked_at_ms: Option<i64>,
}

/// A token that is not revoked, as the checks need it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct ActiveToken {
    pub token_sha256: String,
    pub role: String,
    pub node: Option<String>,
    pub name: Option<String>,
}

#[async_trait]
pub trait TokenStore {
    /// Enrols a token by its hash; returns its id.
    async fn create_token(&self, token: &NewToken<'_>, now_ms: i64) -> Result<i64, StoreError>;
    /// Every token, revoked ones included, oldest first.
    async fn tokens(&self) -> Result<Vec<TokenView>, StoreError>;
    async fn active_tokens(&self) -> Result<Vec<ActiveToken>, StoreError>;
    /// Revokes token `id`; false when there is no such token or it was
    /// already revoked.
    async fn revoke_token(&self, id: i64, now_ms: i64) -> Result<bool, StoreError>;
}

/// The same SQL serves both backends; each store module expands this for
/// its own type (the pools differ).
macro_rules! impl_token_store {
    ($store:ty) => {
        #[async_trait::async_trait]
        impl $crate::tokens::TokenStore for $store {
            async fn create_token(
                &self,
                token: &$crate::tokens::NewToken<'_>,
                now_ms: i64,
            ) -> Result<i64, $crate::StoreError> {
                Ok(sqlx::query_scalar(
                    "INSERT INTO tokens (role, node, name, token_sha256, hint, created_at_ms)
                     VALUES ($1, $2, $3, $4, $5, $6) RETURNING id",
                )
                .bind(token.role.as_str())
                .bind(token.node)
                .bind(token.name)
                .bind(token.token_sha256)
                .bind(token.hint)
                .bind(now_ms)
                .fetch_one(&self.pool)
                .await?)
            }

            async fn tokens(&self) -> Result<Vec<$crate::tokens::TokenView>, $crate::StoreError> {
                Ok(sqlx::query_as(
                    "SELECT id, role, node, name, hint, created_at_ms, revoked_at_ms
                     FROM tokens ORDER BY id",
                )
                .fetch_all(&self.pool)
                .await?)
            }

            async fn active_tokens(
                &self,
            ) -> Result<Vec<$crate::tokens::ActiveToken>, $crate::StoreError> {
                Ok(sqlx::query_as(
                    "SELECT token_sha256, role, node, name FROM tokens WHERE revoked_at_ms IS NULL",
                )
                .fetch_all(&self.pool)
                .await?)
            }

            async fn revoke_token(&self, id: i64, now_ms: i64) -> Result<bool, $crate::StoreError> {
                let done = sqlx::query(
                    "UPDATE tokens SET revoked_at_ms = $1 WHERE id = $2 AND revoked_at_ms IS NULL",
                )
                .bind(now_ms)
                .bind(id)
                .execute(&self.pool)
                .await?;
                Ok(done.rows_affected() == 1)
            }
        }
    };
}
pub(crate) use impl_token_store;
