//! `headroom-collector token …`: enrols, lists and revokes agent tokens.
//! A new token is printed once and only its hash is stored.

use std::io::Write;

use crate::ingest::auth::issue_token;
use crate::store::{Store, StoreError};

#[derive(Debug, Clone, PartialEq, Eq, clap::Subcommand)]
pub enum TokenAction {
    /// Enrol a token for one node (or, with --any-node, for every node) and
    /// print it. It is shown this once.
    Create {
        /// The node name the agent registers as; calls for other nodes are refused.
        #[arg(
            long,
            required_unless_present = "any_node",
            conflicts_with = "any_node"
        )]
        node: Option<String>,
        /// Valid for any node name: one secret for a whole fleet (a
        /// Kubernetes Secret shared by a DaemonSet). Weaker: whoever holds
        /// it can speak for every node.
        #[arg(long)]
        any_node: bool,
    },
    /// List tokens: id, node, the token's first characters, age, state.
    List,
    /// Revoke a token by id; agents using it are refused within seconds,
    /// open streams included.
    Revoke { id: i64 },
}

#[derive(Debug, thiserror::Error)]
pub enum TokenAdminError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("node name {0:?} must be 1..=253 bytes without control characters")]
    BadNode(String),
    #[error("no active token with id {0}")]
    NoSuchToken(i64),
    #[error("writing the output failed: {0}")]
    Output(#[from] std::io::Error),
}

/// Runs `action`; what the operator needs goes to `out`.
pub async fn run(
    store: &dyn Store,
    action: TokenAction,
    now_ms: i64,
    out: &mut impl Write,
) -> Result<(), TokenAdminError> {
    match action {
        TokenAction::Create { node, any_node: _ } => {
            if let Some(node) = &node
                && (node.is_empty() || node.len() > 253 || node.chars().any(char::is_control))
            {
                return Err(TokenAdminError::BadNode(node.clone()));
            }
            let issued = issue_token();
            let id = store
                .create_agent_token(node.as_deref(), &issued.sha256, &issued.hint, now_ms)
                .await?;
            tracing::info!(
                id,
                node = node.as_deref().unwrap_or("*"),
                "agent token created; it is printed once"
            );
            writeln!(out, "{}", issued.token)?;
        }
        TokenAction::List => {
            writeln!(
                out,
                "{:>5}  {:<24}  {:<14}  {:>9}  state",
                "id", "node", "token", "age"
            )?;
            for t in store.agent_tokens().await? {
                let state = match t.revoked_at_ms {
                    Some(at) => format!("revoked {} ago", age(now_ms - at)),
                    None => "active".to_owned(),
                };
                writeln!(
                    out,
                    "{:>5}  {:<24}  {:<14}  {:>9}  {state}",
                    t.id,
                    t.node.as_deref().unwrap_or("* (any node)"),
                    format!("{}…", t.hint),
                    age(now_ms - t.created_at_ms),
                )?;
            }
        }
        TokenAction::Revoke { id } => {
            if !store.revoke_agent_token(id, now_ms).await? {
                return Err(TokenAdminError::NoSuchToken(id));
            }
            writeln!(out, "revoked token {id}")?;
        }
    }
    Ok(())
}

fn age(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86_400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}
