//! `headroom-collector token …`: enrols, lists and revokes the tokens agents
//! and dashboard users present. A new token is printed once and only its
//! hash is stored.

use std::io::Write;

use crate::auth::issue_token;
use headroom_store::tokens::{NewToken, TokenRole};
use headroom_store::{Store, StoreError};

/// The roles a person's token may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DashboardRole {
    /// Reads the dashboard, the API and /metrics.
    Viewer,
    /// Also acknowledges alerts and creates or expires silences.
    Admin,
}

#[derive(Debug, Clone, PartialEq, Eq, clap::Subcommand)]
pub enum TokenAction {
    /// Enrol a token and print it; it is shown this once. An agent token
    /// names its node (--node) or --any-node; a dashboard token names its
    /// --role and who holds it (--name).
    #[command(group(clap::ArgGroup::new("kind").required(true).args(["node", "any_node", "role"])))]
    Create {
        /// Agent token for this node name; calls for other nodes are refused.
        #[arg(long)]
        node: Option<String>,
        /// Agent token valid for any node name: one secret for a whole fleet
        /// (a Kubernetes Secret shared by a DaemonSet). Weaker: whoever
        /// holds it can speak for every node.
        #[arg(long)]
        any_node: bool,
        /// Dashboard and API token (`[http_auth] mode = "tokens"` or "proxy").
        #[arg(long, value_enum, requires = "name")]
        role: Option<DashboardRole>,
        /// Who holds the dashboard token: shown on what they acknowledge or silence.
        #[arg(long, requires = "role")]
        name: Option<String>,
    },
    /// List tokens: id, role, node or holder, the token's first characters,
    /// age, state.
    List,
    /// Revoke a token by id; its agents and browsers are refused within
    /// seconds, open streams included.
    Revoke { id: i64 },
}

#[derive(Debug, thiserror::Error)]
pub enum TokenAdminError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{what} {value:?} must be 1..={max} bytes without control characters")]
    BadName {
        what: &'static str,
        value: String,
        max: usize,
    },
    #[error("no active token with id {0}")]
    NoSuchToken(i64),
    #[error("writing the output failed: {0}")]
    Output(#[from] std::io::Error),
}

fn check_name(what: &'static str, value: &str, max: usize) -> Result<(), TokenAdminError> {
    if value.trim().is_empty() || value.len() > max || value.chars().any(char::is_control) {
        return Err(TokenAdminError::BadName {
            what,
            value: value.to_owned(),
            max,
        });
    }
    Ok(())
}

/// Runs `action`; what the operator needs goes to `out`.
pub async fn run(
    store: &dyn Store,
    action: TokenAction,
    now_ms: i64,
    out: &mut impl Write,
) -> Result<(), TokenAdminError> {
    match action {
        TokenAction::Create {
            node,
            any_node: _,
            role,
            name,
        } => {
            if let Some(node) = &node {
                check_name("node name", node, 253)?;
            }
            if let Some(name) = &name {
                check_name("--name", name, 256)?;
            }
            let role = match role {
                None => TokenRole::Agent,
                Some(DashboardRole::Viewer) => TokenRole::Viewer,
                Some(DashboardRole::Admin) => TokenRole::Admin,
            };
            let issued = issue_token(role);
            let id = store
                .create_token(
                    &NewToken {
                        role,
                        node: node.as_deref(),
                        name: name.as_deref(),
                        token_sha256: &issued.sha256,
                        hint: &issued.hint,
                    },
                    now_ms,
                )
                .await?;
            tracing::info!(
                id,
                role = role.as_str(),
                node = node.as_deref().unwrap_or("-"),
                name = name.as_deref().unwrap_or("-"),
                "token created; it is printed once"
            );
            writeln!(out, "{}", issued.token)?;
        }
        TokenAction::List => {
            writeln!(
                out,
                "{:>5}  {:<6}  {:<24}  {:<14}  {:>9}  state",
                "id", "role", "node / holder", "token", "age"
            )?;
            for t in store.tokens().await? {
                let state = match t.revoked_at_ms {
                    Some(at) => format!("revoked {} ago", age(now_ms - at)),
                    None => "active".to_owned(),
                };
                let whose = match (t.role.as_str(), &t.node, &t.name) {
                    ("agent", Some(node), _) => node.clone(),
                    ("agent", None, _) => "* (any node)".to_owned(),
                    (_, _, Some(name)) => name.clone(),
                    (_, _, None) => "-".to_owned(),
                };
                writeln!(
                    out,
                    "{:>5}  {:<6}  {:<24}  {:<14}  {:>9}  {state}",
                    t.id,
                    t.role,
                    whose,
                    format!("{}…", t.hint),
                    age(now_ms - t.created_at_ms),
                )?;
            }
        }
        TokenAction::Revoke { id } => {
            if !store.revoke_token(id, now_ms).await? {
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
