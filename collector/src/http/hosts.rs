//! Which `Host` a request may name. A page on another site can make a
//! browser send requests to this collector by pointing its own name at
//! 127.0.0.1 (DNS rebinding); the browser then treats the collector as that
//! site and sends `Host: that-site`. Refusing names nobody configured keeps
//! such a page away from a dashboard that asks for no sign-in.
//!
//! IP addresses and `localhost` (and `*.localhost`) are always accepted: no
//! other site can own them. `[http] allowed_hosts` adds names; when it is
//! empty, `[http_auth] mode = "none"` accepts no other name and the modes
//! that sign users in accept any (their cookies and tokens do not follow a
//! rebound name).

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::uri::Authority;
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::auth::HttpAuthMode;
use super::settings::HttpServerConfig;
use crate::metrics::{CollectorMetrics, HttpRefusal};

#[derive(Debug)]
pub struct AllowedHosts {
    /// Any name at all.
    any: bool,
    /// Exact names, lower case, without a trailing dot.
    names: Vec<String>,
    /// From `*.example.com`: `.example.com`.
    suffixes: Vec<String>,
    metrics: Arc<CollectorMetrics>,
}

impl AllowedHosts {
    pub fn new(
        config: &HttpServerConfig,
        mode: HttpAuthMode,
        metrics: Arc<CollectorMetrics>,
    ) -> Self {
        let list = &config.allowed_hosts;
        let any = list.iter().any(|e| e == "*") || (list.is_empty() && mode != HttpAuthMode::None);
        let normal = |e: &str| e.trim_end_matches('.').to_ascii_lowercase();
        Self {
            any,
            names: list
                .iter()
                .filter(|e| !e.starts_with("*"))
                .map(|e| normal(e))
                .collect(),
            suffixes: list
                .iter()
                .filter_map(|e| e.strip_prefix("*."))
                .map(|e| format!(".{}", normal(e)))
                .collect(),
            metrics,
        }
    }

    /// Whether a request for `host` (a `Host` header: a name or address,
    /// perhaps with a port) is served.
    pub fn allows(&self, host: &str) -> bool {
        if self.any {
            return true;
        }
        let Some(name) = host_name(host) else {
            return false;
        };
        is_ip(&name)
            || name == "localhost"
            || name.ends_with(".localhost")
            || self.names.contains(&name)
            || self.suffixes.iter().any(|suffix| name.ends_with(suffix))
    }
}

/// The name of a `Host` value, lower case, without port or trailing dot;
/// `None` when it is not a host at all (user info, a path, garbage).
fn host_name(host: &str) -> Option<String> {
    let authority: Authority = host.parse().ok()?;
    if authority.as_str().contains('@') {
        return None;
    }
    let name = authority.host().trim_end_matches('.').to_ascii_lowercase();
    (!name.is_empty()).then_some(name)
}

fn is_ip(name: &str) -> bool {
    name.trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
        .is_ok()
}

/// Why an `allowed_hosts` entry is not one, for the configuration check.
pub fn entry_problem(entry: &str) -> Option<&'static str> {
    if entry == "*" || is_ip(entry) {
        return None;
    }
    let name = entry.strip_prefix("*.").unwrap_or(entry);
    let valid = !name.is_empty()
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_');
    (!valid).then_some(
        "is not a host name: give the name alone, without scheme, port or path \
         (`gpu-monitor.example.com`, `*.example.com`, or `*` for any)",
    )
}

/// The middleware: refuses a request whose `Host` (or absolute URI) names
/// a host this collector was not told it answers to, with `421 Misdirected
/// Request`. A request with no `Host` at all (HTTP/1.0) comes from no
/// browser and passes.
pub async fn check_host(
    State(hosts): State<Arc<AllowedHosts>>,
    request: Request,
    next: Next,
) -> Response {
    if hosts.any {
        return next.run(request).await;
    }
    let mut values = request.headers().get_all(header::HOST).iter();
    let claimed = match (request.uri().authority(), values.next(), values.next()) {
        (_, Some(_), Some(_)) => Err("more than one Host header".to_owned()),
        (Some(authority), _, _) => Ok(Some(authority.as_str().to_owned())),
        (None, Some(value), None) => value
            .to_str()
            .map(|v| Some(v.to_owned()))
            .map_err(|_| "a Host header that is not text".to_owned()),
        (None, None, _) => Ok(None),
    };
    let refusal = match claimed {
        Ok(None) => return next.run(request).await,
        Ok(Some(host)) if hosts.allows(&host) => return next.run(request).await,
        Ok(Some(host)) => format!(
            "this collector does not answer to host {host:?}: it serves IP addresses, \
             localhost and the names in [http] allowed_hosts"
        ),
        Err(what) => format!("refused a request with {what}"),
    };
    hosts.metrics.http_refused(HttpRefusal::Host);
    tracing::debug!(host = ?request.headers().get(header::HOST), path = request.uri().path(),
        "refused a request for another host");
    (
        StatusCode::MISDIRECTED_REQUEST,
        axum::Json(serde_json::json!({ "error": refusal })),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(list: &[&str], mode: HttpAuthMode) -> AllowedHosts {
        let config = HttpServerConfig {
            allowed_hosts: list.iter().map(|s| (*s).to_owned()).collect(),
            ..HttpServerConfig::default()
        };
        AllowedHosts::new(&config, mode, Arc::default())
    }

    #[test]
    fn without_sign_in_only_addresses_localhost_and_listed_names_pass() {
        let open = hosts(&[], HttpAuthMode::None);
        for ok in [
            "localhost",
            "localhost:8080",
            "LOCALHOST.",
            "app.localhost:3000",
            "127.0.0.1:8080",
            "[::1]:8080",
            "[::1]",
            "10.1.2.3",
        ] {
            assert!(open.allows(ok), "{ok}");
        }
        for refused in [
            "attacker.test",
            "attacker.test:8080",
            "127.0.0.1.attacker.test",
            "localhost.attacker.test",
            "user@localhost",
            "",
            "local host",
        ] {
            assert!(!open.allows(refused), "{refused}");
        }
        let listed = hosts(
            &["gpu-monitor.example.com", "*.corp.example"],
            HttpAuthMode::None,
        );
        assert!(listed.allows("GPU-Monitor.example.com:443"));
        assert!(listed.allows("a.b.corp.example"));
        assert!(!listed.allows("corp.example.attacker.test"));
        assert!(!listed.allows("attacker.test"));
    }

    #[test]
    fn signed_in_modes_accept_any_name_unless_a_list_is_given() {
        assert!(hosts(&[], HttpAuthMode::Tokens).allows("anything.example"));
        assert!(hosts(&["*"], HttpAuthMode::None).allows("anything.example"));
        let listed = hosts(&["gpu.example.com"], HttpAuthMode::Proxy);
        assert!(!listed.allows("anything.example"));
        assert!(listed.allows("gpu.example.com"));
    }

    #[test]
    fn entries_must_be_bare_names() {
        for ok in ["gpu.example.com", "*.example.com", "*", "10.0.0.1", "::1"] {
            assert_eq!(entry_problem(ok), None, "{ok}");
        }
        for bad in [
            "https://gpu.example.com",
            "gpu.example.com:8080",
            "a/b",
            "",
            "*.",
        ] {
            assert!(entry_problem(bad).is_some(), "{bad:?}");
        }
    }
}
