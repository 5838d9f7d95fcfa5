//! Which Postgres server takes the writes, when the URL names several.
//!
//! sqlx connects to one host. A libpq-style URL with a host list
//! (`postgres://user@db-a:5432,db-b:5432/headroom?target_session_attrs=read-write`)
//! is split here into one set of options per host; the collector connects
//! to the first host that accepts writes and, while it runs, checks once a
//! second that its host still does. When the host stops answering or turns
//! read-only (a standby, or an old primary fenced by the failover tool), the
//! hosts are tried again in order and the first writable one becomes the
//! target of the pool, the ingest writers and the maintenance lock. Writes
//! in between fail, and the agents keep those batches in their spools and
//! send them again: the sequence claims committed with the data make the
//! replay store each interval once.

use std::sync::RwLock;
use std::time::{Duration, Instant};

use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection};

use crate::StoreError;
use crate::connection::redact_url;

/// How long one host gets to answer before the next is tried.
const HOST_TIMEOUT: Duration = Duration::from_secs(2);

/// What a host must accept to be connected to, as libpq's
/// `target_session_attrs` says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SessionAttrs {
    /// The first host that answers.
    Any,
    /// The first host whose sessions are read-write by default.
    ReadWrite,
}

/// The hosts of a database URL and the one now written to.
#[derive(Debug)]
pub(crate) struct Primary {
    hosts: Vec<(String, PgConnectOptions)>,
    attrs: SessionAttrs,
    current: RwLock<Current>,
}

#[derive(Debug, Clone)]
struct Current {
    index: usize,
    since: Instant,
}

impl Primary {
    /// Splits `url` into its hosts; one host gives one set of options, as
    /// sqlx would parse it.
    pub(crate) fn parse(url: &str) -> Result<Self, StoreError> {
        let bad = |why: &str| StoreError::Invalid(format!("{why} in {}", redact_url(url)));
        let scheme_end = url.find("://").ok_or_else(|| bad("no scheme"))?;
        let rest = &url[scheme_end + 3..];
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(authority_end);
        let (userinfo, host_list) = match authority.rfind('@') {
            Some(at) => (&authority[..=at], &authority[at + 1..]),
            None => ("", authority),
        };
        let (path, query) = match tail.find('?') {
            Some(q) => (&tail[..q], &tail[q + 1..]),
            None => (tail, ""),
        };
        let mut attrs = SessionAttrs::Any;
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("target_session_attrs", value)) => {
                    attrs = match value {
                        "any" => SessionAttrs::Any,
                        "read-write" | "primary" => SessionAttrs::ReadWrite,
                        other => {
                            return Err(bad(&format!(
                                "target_session_attrs \"{other}\" is not supported (any, read-write, primary)"
                            )));
                        }
                    }
                }
                _ => kept.push(pair),
            }
        }
        let query = if kept.is_empty() {
            String::new()
        } else {
            format!("?{}", kept.join("&"))
        };
        let mut hosts = Vec::new();
        let several = host_list.contains(',');
        for host in host_list.split(',') {
            // One empty host is sqlx's default (or a `host=` parameter).
            if host.is_empty() && several {
                return Err(bad("an empty host in the host list"));
            }
            let one = format!("{}://{userinfo}{host}{path}{query}", &url[..scheme_end]);
            hosts.push((host.to_owned(), one.parse::<PgConnectOptions>()?));
        }
        Ok(Self {
            hosts,
            attrs,
            current: RwLock::new(Current {
                index: 0,
                since: Instant::now(),
            }),
        })
    }

    /// Whether there is anywhere else to go.
    pub(crate) fn has_standbys(&self) -> bool {
        self.hosts.len() > 1
    }

    fn current(&self) -> Current {
        match self.current.read() {
            Ok(current) => current.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// The options of the host written to now.
    pub(crate) fn options(&self) -> PgConnectOptions {
        self.hosts[self.current().index].1.clone()
    }

    /// `host:port` of the host written to now, for logs.
    pub(crate) fn host(&self) -> &str {
        &self.hosts[self.current().index].0
    }

    /// When the target last changed: connections opened before belong to
    /// a host that is no longer the one written to.
    pub(crate) fn switched_at(&self) -> Instant {
        self.current().since
    }

    /// Whether `conn` is on a host that takes what `attrs` asks.
    async fn acceptable(&self, conn: &mut PgConnection) -> bool {
        match self.attrs {
            SessionAttrs::Any => true,
            SessionAttrs::ReadWrite => {
                let read_only: Result<String, _> = sqlx::query_scalar("SHOW transaction_read_only")
                    .fetch_one(&mut *conn)
                    .await;
                matches!(read_only.as_deref(), Ok("off"))
            }
        }
    }

    /// Whether the current host still takes writes.
    pub(crate) async fn current_is_acceptable(&self) -> bool {
        let options = self.options();
        tokio::time::timeout(HOST_TIMEOUT, async {
            match PgConnection::connect_with(&options).await {
                Ok(mut conn) => {
                    let ok = self.acceptable(&mut conn).await;
                    let _ = conn.close().await;
                    ok
                }
                Err(_) => false,
            }
        })
        .await
        .unwrap_or(false)
    }

    /// Tries the hosts in order and makes the first acceptable one current;
    /// its index, or an error naming what each host answered.
    pub(crate) async fn find(&self) -> Result<usize, StoreError> {
        let mut answers = Vec::new();
        for (index, (host, options)) in self.hosts.iter().enumerate() {
            let answer = tokio::time::timeout(HOST_TIMEOUT, async {
                let mut conn = PgConnection::connect_with(options).await?;
                let ok = self.acceptable(&mut conn).await;
                let _ = conn.close().await;
                Ok::<bool, sqlx::Error>(ok)
            })
            .await;
            match answer {
                Ok(Ok(true)) => {
                    let mut current = match self.current.write() {
                        Ok(current) => current,
                        Err(poisoned) => poisoned.into_inner(),
                    };
                    if current.index != index {
                        *current = Current {
                            index,
                            since: Instant::now(),
                        };
                    }
                    return Ok(index);
                }
                Ok(Ok(false)) => answers.push(format!("{host}: read-only")),
                Ok(Err(error)) => answers.push(format!("{host}: {error}")),
                Err(_) => answers.push(format!("{host}: no answer in {HOST_TIMEOUT:?}")),
            }
        }
        Err(StoreError::Invalid(format!(
            "no host takes writes ({})",
            answers.join("; ")
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_host_is_parsed_as_sqlx_would() {
        let primary =
            Primary::parse("postgres://headroom:pw@db:5433/metrics?sslmode=disable").unwrap();
        assert!(!primary.has_standbys());
        assert_eq!(primary.attrs, SessionAttrs::Any);
        let options = primary.options();
        assert_eq!(options.get_host(), "db");
        assert_eq!(options.get_port(), 5433);
        assert_eq!(options.get_database(), Some("metrics"));
        assert_eq!(options.get_username(), "headroom");
    }

    #[test]
    fn a_url_without_a_host_keeps_its_socket_parameter() {
        let primary = Primary::parse("postgres:///metrics?host=/run/postgresql").unwrap();
        assert!(!primary.has_standbys());
        assert_eq!(
            primary.options().get_socket(),
            Some(&"/run/postgresql".into())
        );
    }

    #[test]
    fn a_host_list_gives_one_target_per_host_with_the_same_user_and_database() {
        let primary = Primary::parse(
            "postgresql://headroom:pw@db-a:5432,db-b:6432,db-c/metrics?target_session_attrs=read-write&application_name=hr",
        )
        .unwrap();
        assert!(primary.has_standbys());
        assert_eq!(primary.attrs, SessionAttrs::ReadWrite);
        let hosts: Vec<(&str, u16, Option<&str>, &str)> = primary
            .hosts
            .iter()
            .map(|(_, o)| {
                (
                    o.get_host(),
                    o.get_port(),
                    o.get_database(),
                    o.get_username(),
                )
            })
            .collect();
        assert_eq!(
            hosts,
            [
                ("db-a", 5432, Some("metrics"), "headroom"),
                ("db-b", 6432, Some("metrics"), "headroom"),
                ("db-c", 5432, Some("metrics"), "headroom"),
            ]
        );
        assert_eq!(primary.host(), "db-a:5432");
        assert_eq!(
            primary.hosts[1].1.get_application_name(),
            Some("hr"),
            "other parameters stay"
        );
    }

    #[test]
    fn bad_host_lists_and_attributes_are_named_without_the_password() {
        for (url, expected) in [
            ("postgres://u:secret@a,,b/db", "an empty host"),
            (
                "postgres://u:secret@a,b/db?target_session_attrs=prefer-standby",
                "\"prefer-standby\" is not supported",
            ),
        ] {
            let error = Primary::parse(url).unwrap_err().to_string();
            assert!(error.contains(expected), "{error}");
            assert!(!error.contains("secret"), "{error}");
        }
    }
}
