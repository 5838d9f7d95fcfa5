//! Agent tokens: enrolled and revoked by an operator (`headroom-collector
//! token`), checked on every gRPC call. The store keeps a SHA-256 of each
//! token, never the token.

use async_trait::async_trait;
use serde::Serialize;

use super::StoreError;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct AgentTokenView {
    pub id: i64,
    /// `None`: valid for any node name.
    pub node: Option<String>,
    /// The token's first characters.
    pub hint: String,
    pub created_at_ms: i64,
    pub revoked_at_ms: Option<i64>,
}

/// A token that is not revoked, as the ingest check needs it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct ActiveToken {
    pub token_sha256: String,
    pub node: Option<String>,
}

#[async_trait]
pub trait TokenStore {
    /// Enrols a token by its hash; returns its id.
    async fn create_agent_token(
        &self,
        node: Option<&str>,
        token_sha256: &str,
        hint: &str,
        now_ms: i64,
    ) -> Result<i64, StoreError>;
    /// Every token, revoked ones included, oldest first.
    async fn agent_tokens(&self) -> Result<Vec<AgentTokenView>, StoreError>;
    async fn active_agent_tokens(&self) -> Result<Vec<ActiveToken>, StoreError>;
    /// Revokes token `id`; false when there is no such token or it was
    /// already revoked.
    async fn revoke_agent_token(&self, id: i64, now_ms: i64) -> Result<bool, StoreError>;
}

/// The same SQL serves both backends; each store module expands this for
/// its own type (the pools differ).
macro_rules! impl_token_store {
    ($store:ty) => {
        #[async_trait::async_trait]
        impl $crate::store::tokens::TokenStore for $store {
            async fn create_agent_token(
                &self,
                node: Option<&str>,
                token_sha256: &str,
                hint: &str,
                now_ms: i64,
            ) -> Result<i64, $crate::store::StoreError> {
                Ok(sqlx::query_scalar(
                    "INSERT INTO agent_tokens (node, token_sha256, hint, created_at_ms)
                     VALUES ($1, $2, $3, $4) RETURNING id",
                )
                .bind(node)
                .bind(token_sha256)
                .bind(hint)
                .bind(now_ms)
                .fetch_one(&self.pool)
                .await?)
            }

            async fn agent_tokens(
                &self,
            ) -> Result<Vec<$crate::store::tokens::AgentTokenView>, $crate::store::StoreError>
            {
                Ok(sqlx::query_as(
                    "SELECT id, node, hint, created_at_ms, revoked_at_ms FROM agent_tokens ORDER BY id",
                )
                .fetch_all(&self.pool)
                .await?)
            }

            async fn active_agent_tokens(
                &self,
            ) -> Result<Vec<$crate::store::tokens::ActiveToken>, $crate::store::StoreError> {
                Ok(sqlx::query_as(
                    "SELECT token_sha256, node FROM agent_tokens WHERE revoked_at_ms IS NULL",
                )
                .fetch_all(&self.pool)
                .await?)
            }

            async fn revoke_agent_token(
                &self,
                id: i64,
                now_ms: i64,
            ) -> Result<bool, $crate::store::StoreError> {
                let done = sqlx::query(
                    "UPDATE agent_tokens SET revoked_at_ms = $1 WHERE id = $2 AND revoked_at_ms IS NULL",
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
