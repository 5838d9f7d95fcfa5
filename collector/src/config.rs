//! Collector configuration, in layers: built-in defaults, then a TOML file,
//! then `HEADROOM_*` environment variables and flags (read by clap).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use headroom_common::tls::{TlsError, read_pem};
use serde::{Deserialize, Serialize};
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

use crate::http::HttpServerConfig;
use crate::http::auth::{HttpAuthConfig, HttpAuthMode};
use crate::ingest::WriterConfig;
use crate::ingest::validate::Limits;
use headroom_store::rollup::StorageConfig;

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct CollectorConfig {
    /// Where agents connect (gRPC).
    pub grpc_listen: SocketAddr,
    /// Dashboard and JSON API. Loopback by default: with `[http_auth]
    /// mode = "none"` whoever reaches it may act.
    pub http_listen: SocketAddr,
    /// `postgres://user@host/db` or `sqlite://path/to/headroom.db`.
    pub database_url: String,
    /// How the batches of many agents are coalesced into writes.
    pub ingest: WriterConfig,
    /// Retention per resolution and the maintenance that applies it.
    pub storage: StorageConfig,
    /// Who may send samples.
    pub agents: AgentsConfig,
    /// TLS for the gRPC port.
    pub tls: TlsConfig,
    /// Who may read the dashboard and API, and who may act.
    pub http_auth: HttpAuthConfig,
    /// What the HTTP server accepts: `Host` names, connections, live-stream
    /// clients, and how long a connection may be slow or idle.
    pub http: HttpServerConfig,
    /// Bounds on what one agent may send; more is refused with
    /// `INVALID_ARGUMENT` and counted.
    pub limits: Limits,
    /// Several collectors sharing one Postgres database.
    pub cluster: ClusterConfig,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// Where the other collectors sharing the database reach this one's
    /// HTTP port (`http://10.0.0.5:8080`): their charts ask it for the
    /// samples of the agents connected here that are not yet written. Left
    /// out, their charts of those GPUs trail by up to `chunk_flush_s`.
    pub advertise_url: Option<String>,
}

impl ClusterConfig {
    fn problem(&self) -> Option<String> {
        let url = self.advertise_url.as_deref()?;
        let parsed = match reqwest::Url::parse(url) {
            Ok(parsed) => parsed,
            Err(e) => {
                return Some(format!(
                    "[cluster] advertise_url {url:?}: {e} (write it as http://host:port)"
                ));
            }
        };
        if !matches!(parsed.scheme(), "http" | "https") {
            return Some(format!(
                "[cluster] advertise_url {url:?}: needs http:// or https://"
            ));
        }
        let host = parsed.host_str().unwrap_or_default();
        let unspecified = host.is_empty()
            || host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_unspecified());
        unspecified.then(|| {
            format!(
                "[cluster] advertise_url {url:?}: other collectors cannot reach an unspecified \
                 address; name this host (its IP or DNS name)"
            )
        })
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// PEM certificate chain the collector presents to agents; with
    /// `key_file`, gRPC is served over TLS only.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// PEM CA bundle: agents must present a certificate it signed (mutual TLS).
    pub client_ca_file: Option<PathBuf>,
}

impl TlsConfig {
    fn problem(&self) -> Option<String> {
        match (&self.cert_file, &self.key_file, &self.client_ca_file) {
            (Some(_), None, _) | (None, Some(_), _) => {
                Some("[tls] cert_file and key_file go together".into())
            }
            (None, None, Some(_)) => Some(
                "[tls] client_ca_file needs cert_file and key_file (mutual TLS is TLS first)"
                    .into(),
            ),
            _ => None,
        }
    }

    /// Reads the files; `None` when TLS is off.
    pub fn server_config(&self) -> Result<Option<ServerTlsConfig>, TlsError> {
        let (Some(cert), Some(key)) = (&self.cert_file, &self.key_file) else {
            return Ok(None);
        };
        let mut config = ServerTlsConfig::new().identity(Identity::from_pem(
            read_pem(cert, "[tls] cert_file")?,
            read_pem(key, "[tls] key_file")?,
        ));
        if let Some(ca) = &self.client_ca_file {
            config =
                config.client_ca_root(Certificate::from_pem(read_pem(ca, "[tls] client_ca_file")?));
        }
        Ok(Some(config))
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentsConfig {
    /// Refuse gRPC calls without an enrolled, unrevoked token for the node
    /// they speak for (`headroom-collector token create`). Off by default so
    /// the one-machine demo needs no setup; turn it on in any real fleet.
    pub require_token: bool,
}

impl Default for CollectorConfig {
    fn default() -> Self {
        Self {
            grpc_listen: SocketAddr::from(([0, 0, 0, 0], 50051)),
            http_listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            database_url: "sqlite://headroom-data/headroom.db".into(),
            ingest: WriterConfig::default(),
            storage: StorageConfig::default(),
            agents: AgentsConfig::default(),
            tls: TlsConfig::default(),
            http_auth: HttpAuthConfig::default(),
            http: HttpServerConfig::default(),
            limits: Limits::default(),
            cluster: ClusterConfig::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("configuration: {0}")]
    Invalid(String),
}

#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub grpc_listen: Option<SocketAddr>,
    pub http_listen: Option<SocketAddr>,
    pub http_auth: Option<HttpAuthMode>,
    pub database_url: Option<String>,
    pub advertise_url: Option<String>,
}

impl CollectorConfig {
    /// The built-in defaults as a configuration file.
    pub fn default_toml() -> String {
        let body = toml::to_string(&Self::default())
            .unwrap_or_else(|e| format!("# cannot render the defaults: {e}\n"));
        format!(
            "# headroom-collector built-in defaults (headroom-collector print-default-config).\n\
             # Every key is explained in deploy/collector.toml.\n{body}"
        )
    }

    pub fn load(file: Option<&Path>, overrides: Overrides) -> Result<Self, ConfigError> {
        let mut config = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.to_owned(),
                    source,
                })?;
                toml::from_str(&text).map_err(|e| ConfigError::Parse {
                    path: path.to_owned(),
                    message: e.to_string(),
                })?
            }
            None => Self::default(),
        };
        if let Some(v) = overrides.grpc_listen {
            config.grpc_listen = v;
        }
        if let Some(v) = overrides.http_listen {
            config.http_listen = v;
        }
        if let Some(v) = overrides.http_auth {
            config.http_auth.mode = v;
        }
        if let Some(v) = overrides.database_url {
            config.database_url = v;
        }
        if let Some(v) = overrides.advertise_url {
            config.cluster.advertise_url = Some(v);
        }
        if let Some(problem) = config
            .storage
            .problem()
            .or_else(|| config.ingest.problem())
            .or_else(|| config.tls.problem())
            .or_else(|| config.http_auth.problem())
            .or_else(|| config.http.problem())
            .or_else(|| config.limits.problem())
            .or_else(|| config.cluster.problem())
        {
            return Err(match file {
                Some(path) => ConfigError::Parse {
                    path: path.to_owned(),
                    message: problem,
                },
                None => ConfigError::Invalid(problem),
            });
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn example_config_parses_and_flags_win() {
        let path = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/collector.toml"
        ));
        let config = CollectorConfig::load(
            Some(path),
            Overrides {
                http_listen: Some("0.0.0.0:9999".parse().unwrap()),
                ..Overrides::default()
            },
        )
        .unwrap();
        assert!(config.database_url.starts_with("postgres://"));
        assert_eq!(config.http_listen.port(), 9999);
        assert!(config.agents.require_token, "the example is a real fleet's");
        assert!(config.tls.cert_file.is_some());
        assert_eq!(config.http_auth.mode, HttpAuthMode::Tokens);
        assert_eq!(config.http_auth.admin_users, ["alice", "bob"]);
        let proxied = CollectorConfig::load(
            Some(path),
            Overrides {
                http_auth: Some(HttpAuthMode::Proxy),
                ..Overrides::default()
            },
        )
        .unwrap();
        assert_eq!(proxied.http_auth.mode, HttpAuthMode::Proxy, "the flag wins");
    }

    #[test]
    fn limits_load_from_the_file_and_a_too_short_age_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "[limits]\nmax_future_skew_ms = 60000\n").unwrap();
        let config = CollectorConfig::load(Some(&path), Overrides::default()).unwrap();
        assert_eq!(config.limits.max_future_skew_ms, 60_000);
        assert_eq!(config.limits.max_age_ms, Limits::default().max_age_ms);
        std::fs::write(&path, "[limits]\nmax_age_ms = 1000\n").unwrap();
        let err = CollectorConfig::load(Some(&path), Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("max_age_ms") && err.contains("c.toml"),
            "{err}"
        );
    }

    #[test]
    fn an_advertised_url_others_cannot_reach_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        for (url, says) in [
            ("http://0.0.0.0:8080", "unspecified"),
            ("http://[::]:8080", "unspecified"),
            ("10.0.0.5:8080", "http://"),
            ("not a url", "advertise_url"),
        ] {
            std::fs::write(&path, format!("[cluster]\nadvertise_url = {url:?}\n")).unwrap();
            let err = CollectorConfig::load(Some(&path), Overrides::default())
                .unwrap_err()
                .to_string();
            assert!(err.contains(says) && err.contains("c.toml"), "{url}: {err}");
        }
        let config = CollectorConfig::load(
            Some(&path),
            Overrides {
                advertise_url: Some("http://collector-0.headroom:8080".into()),
                ..Overrides::default()
            },
        )
        .unwrap();
        assert_eq!(
            config.cluster.advertise_url.as_deref(),
            Some("http://collector-0.headroom:8080"),
            "the flag wins"
        );
    }

    #[test]
    fn a_client_ca_without_a_server_certificate_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "[tls]\nclient_ca_file = \"/etc/ca.crt\"\n").unwrap();
        let err = CollectorConfig::load(Some(&path), Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("client_ca_file") && err.contains("c.toml"),
            "{err}"
        );
    }

    #[test]
    fn retention_that_shrinks_with_the_step_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            "[storage]\nraw_retention_days = 30\nminute_retention_days = 14\n",
        )
        .unwrap();
        let err = CollectorConfig::load(Some(&path), Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("raw 30 d") && err.contains("c.toml"), "{err}");
    }

    #[test]
    fn http_limits_load_from_the_file_and_nonsense_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        let defaults = CollectorConfig::load(None, Overrides::default()).unwrap();
        assert_eq!(defaults.http, HttpServerConfig::default());
        assert_eq!(defaults.http.max_connections, 1024);
        assert_eq!(defaults.http.max_stream_clients, 256);
        std::fs::write(
            &path,
            "[http]\nallowed_hosts = [\"gpu-monitor.example.com\", \"*.corp.example\"]\n\
             max_connections = 64\nheader_read_timeout_s = 5\nidle_timeout_s = 30\n\
             max_stream_clients = 8\nstream_devices_max = 100\n",
        )
        .unwrap();
        let config = CollectorConfig::load(Some(&path), Overrides::default()).unwrap();
        assert_eq!(
            config.http,
            HttpServerConfig {
                allowed_hosts: vec!["gpu-monitor.example.com".into(), "*.corp.example".into()],
                max_connections: 64,
                header_read_timeout_s: 5,
                idle_timeout_s: 30,
                max_stream_clients: 8,
                stream_devices_max: 100,
            }
        );
        for (text, names) in [
            ("[http]\nmax_connections = 0\n", "max_connections"),
            (
                "[http]\nheader_read_timeout_s = 0\n",
                "header_read_timeout_s",
            ),
            (
                "[http]\nmax_connections = 100\nmax_stream_clients = 100\n",
                "max_stream_clients",
            ),
            (
                "[http]\nallowed_hosts = [\"https://gpu.example.com:8080\"]\n",
                "https://gpu.example.com:8080",
            ),
            ("[http]\nallowed_host = []\n", "allowed_host"),
        ] {
            std::fs::write(&path, text).unwrap();
            let err = CollectorConfig::load(Some(&path), Overrides::default())
                .unwrap_err()
                .to_string();
            assert!(err.contains(names) && err.contains("c.toml"), "{err}");
        }
    }

    #[test]
    fn typo_in_a_key_names_the_key_and_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "databse_url = \"x\"\n").unwrap();
        let err = CollectorConfig::load(Some(&path), Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("databse_url") && err.contains("c.toml"),
            "{err}"
        );
    }
}
