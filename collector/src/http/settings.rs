//! `[http]`: what the HTTP server accepts before a request reaches a
//! handler: which `Host` names, how many connections and live streams at
//! once, and how long a connection may take to send a request or sit idle.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpServerConfig {
    /// Host names (no scheme, no port) requests may be addressed to, besides
    /// IP addresses and `localhost`, which are always accepted; `*.domain`
    /// accepts its subdomains and `*` any name. Empty: with `[http_auth]
    /// mode = "none"` no other name (a DNS-rebinding page's cannot reach
    /// the open dashboard), in the other modes any name.
    pub allowed_hosts: Vec<String>,
    /// Connections served at once; one more is answered `503` and closed.
    pub max_connections: u32,
    /// Seconds a client has to send a request's headers, counted from when
    /// the connection opens or its previous response ends: a slow sender
    /// (slowloris) or an idle keep-alive connection is closed after it.
    pub header_read_timeout_s: u32,
    /// Seconds a connection may pass without a byte read or written: a
    /// stalled body upload, a client that stopped reading a response.
    pub idle_timeout_s: u32,
    /// Clients of the live stream (`/api/v1/stream`) at once; one more is
    /// answered `503` with `Retry-After`.
    pub max_stream_clients: u32,
    /// Devices the live stream sends one by one. A fleet with more is sent
    /// to a client that did not name a node as a row per node and the
    /// devices at risk (a dashboard shows a cell per node); a client that
    /// names one (`/api/v1/stream?node=NAME`) gets its devices whatever
    /// the fleet's size.
    pub stream_devices_max: u32,
}

impl Default for HttpServerConfig {
    fn default() -> Self {
        Self {
            allowed_hosts: Vec::new(),
            max_connections: 1024,
            header_read_timeout_s: 10,
            idle_timeout_s: 60,
            max_stream_clients: 256,
            stream_devices_max: 5_000,
        }
    }
}

impl HttpServerConfig {
    pub fn problem(&self) -> Option<String> {
        for (name, value) in [
            ("max_connections", self.max_connections),
            ("header_read_timeout_s", self.header_read_timeout_s),
            ("idle_timeout_s", self.idle_timeout_s),
            ("max_stream_clients", self.max_stream_clients),
        ] {
            if value == 0 {
                return Some(format!("[http] {name} = 0: it must be at least 1"));
            }
        }
        if self.max_stream_clients >= self.max_connections {
            return Some(format!(
                "[http] max_stream_clients = {} must be below max_connections = {}: \
                 each stream holds a connection, and the API needs some too",
                self.max_stream_clients, self.max_connections
            ));
        }
        self.allowed_hosts.iter().find_map(|entry| {
            super::hosts::entry_problem(entry)
                .map(|why| format!("[http] allowed_hosts entry {entry:?} {why}"))
        })
    }
}
