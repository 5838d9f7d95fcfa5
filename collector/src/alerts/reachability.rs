//! A notifier nobody can reach is a configuration error an operator wants to
//! hear about when the collector starts, not at the first OOM: each
//! channel's host must resolve and take a TCP connection. Alertmanager is
//! deployed in HA pairs, so one instance of a channel down is a warning and
//! all of them down is the error.

use std::time::Duration;

use headroom_rules::config::NotifyConfig;

use super::channels::{Channel, Target};

/// How long one host gets to resolve and accept a connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// A channel no request could reach. Names the rules-file key and the
/// host and port only: a URL may carry a token or credentials.
#[derive(Debug, thiserror::Error)]
#[error(
    "{key}: cannot reach {endpoint}: {reason} (start with --allow-unreachable-notifiers to queue its notifications until it answers)"
)]
pub struct Unreachable {
    pub key: String,
    pub endpoint: String,
    pub reason: String,
}

/// Connects once to every channel's host. `Ok` holds what to warn about:
/// Alertmanager instances down beside one that answers.
pub async fn check(
    config: &NotifyConfig,
    channels: &[Channel],
    timeout: Duration,
) -> Result<Vec<Unreachable>, Unreachable> {
    for channel in channels {
        let (kind, key, url) = match &channel.target {
            Target::Webhook { url, .. } => ("webhook", "url", url),
            Target::Slack { url } => ("slack", "webhook_url", url),
            Target::PagerDuty { url, .. } => ("pagerduty", "url", url),
        };
        reach(url, timeout)
            .await
            .map_err(|(endpoint, reason)| Unreachable {
                key: format!("notify.{kind} {:?}: {key}", channel.name),
                endpoint,
                reason,
            })?;
    }
    let mut warnings = Vec::new();
    for am in &config.alertmanager {
        let mut down = Vec::new();
        for (i, url) in am.urls.iter().enumerate() {
            if let Err((endpoint, reason)) = reach(url, timeout).await {
                down.push(Unreachable {
                    key: format!("notify.alertmanager {:?}: urls[{i}]", am.name),
                    endpoint,
                    reason,
                });
            }
        }
        if down.len() == am.urls.len() && !down.is_empty() {
            let first = down.swap_remove(0);
            let reason = if am.urls.len() > 1 {
                format!("{} (and none of its other urls answers)", first.reason)
            } else {
                first.reason
            };
            return Err(Unreachable { reason, ..first });
        }
        warnings.extend(down);
    }
    Ok(warnings)
}

/// `Err((host:port, why))` when `url`'s host does not resolve or accept a
/// connection within `timeout`.
async fn reach(url: &str, timeout: Duration) -> Result<(), (String, String)> {
    let parsed = reqwest::Url::parse(url).map_err(|e| ("the URL".to_owned(), e.to_string()))?;
    let host = parsed.host_str().unwrap_or_default().to_owned();
    let port = parsed.port_or_known_default().unwrap_or(443);
    let endpoint = format!("{host}:{port}");
    // A bracketed IPv6 literal resolves without its brackets.
    let target = (host.trim_matches(['[', ']']).to_owned(), port);
    match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(target)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err((endpoint, e.to_string())),
        Err(_) => Err((endpoint, format!("no answer within {timeout:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_rules::config::RulesConfig;

    fn config(text: &str) -> NotifyConfig {
        RulesConfig::parse(text, std::path::Path::new("rules.toml"))
            .unwrap()
            .notify
    }

    /// A loopback port nothing listens on.
    fn closed_port() -> u16 {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    }

    #[tokio::test]
    async fn a_webhook_nobody_answers_is_refused_by_its_key_without_the_url_path() {
        let port = closed_port();
        let notify = config(&format!(
            "[[notify.webhook]]\nname = \"ops\"\nurl = \"http://127.0.0.1:{port}/hook?token=s3cret\"\nsecret = \"x\"\n"
        ));
        let channels = super::super::channels::from_config(&notify).unwrap();
        let error = check(&notify, &channels, CONNECT_TIMEOUT)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            error.starts_with("notify.webhook \"ops\": url: cannot reach 127.0.0.1:"),
            "{error}"
        );
        assert!(
            !error.contains("s3cret") && !error.contains("/hook"),
            "{error}"
        );
    }

    #[tokio::test]
    async fn one_alertmanager_down_of_two_is_a_warning_and_both_down_an_error() {
        let up = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let up = up.local_addr().unwrap().port();
        let down = closed_port();
        let pair = config(&format!(
            "[[notify.alertmanager]]\nname = \"am\"\nurls = [\"http://127.0.0.1:{down}\", \"http://127.0.0.1:{up}\"]\n"
        ));
        let warnings = check(&pair, &[], CONNECT_TIMEOUT).await.unwrap();
        assert_eq!(warnings.len(), 1);
        assert_eq!(warnings[0].key, "notify.alertmanager \"am\": urls[0]");

        let none = config(&format!(
            "[[notify.alertmanager]]\nname = \"am\"\nurls = [\"http://127.0.0.1:{down}\"]\n"
        ));
        let error = check(&none, &[], CONNECT_TIMEOUT).await.unwrap_err();
        assert_eq!(error.key, "notify.alertmanager \"am\": urls[0]");
    }

    #[tokio::test]
    async fn a_host_that_does_not_resolve_is_refused() {
        let notify = config(
            "[[notify.pagerduty]]\nname = \"pd\"\nrouting_key = \"k\"\nurl = \"https://no-such-host.invalid/v2/enqueue\"\n",
        );
        let channels = super::super::channels::from_config(&notify).unwrap();
        let error = check(&notify, &channels, CONNECT_TIMEOUT)
            .await
            .unwrap_err();
        assert_eq!(error.key, "notify.pagerduty \"pd\": url");
        assert_eq!(error.endpoint, "no-such-host.invalid:443");
    }
}
