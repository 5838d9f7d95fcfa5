//! Where outbox notifications go: signed JSON webhooks, Slack incoming
//! webhooks and PagerDuty's Events API. (Alertmanager is kept in step by
//! `alertmanager.rs`, without the outbox.)

use std::collections::HashMap;
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use headroom_rules::config::{NotifyConfig, Severity};
use headroom_store::alerts::OutboxItem;

#[derive(Clone)]
pub enum Target {
    Webhook { url: String, secret: Vec<u8> },
    Slack { url: String },
    PagerDuty { url: String, routing_key: String },
}

// URLs and secrets stay out of logs.
impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Webhook { .. } => "Webhook(<redacted>)",
            Self::Slack { .. } => "Slack(<redacted>)",
            Self::PagerDuty { .. } => "PagerDuty(<redacted>)",
        })
    }
}

#[derive(Debug, Clone)]
pub struct Channel {
    pub name: String,
    pub min_severity: Severity,
    pub target: Target,
}

#[derive(Debug, thiserror::Error)]
#[error("notification channel {channel:?}: cannot read {path}: {source}")]
pub struct SecretError {
    channel: String,
    path: String,
    source: std::io::Error,
}

fn read_secret(channel: &str, path: &std::path::Path) -> Result<String, SecretError> {
    std::fs::read_to_string(path)
        .map(|s| s.trim_end_matches(['\n', '\r']).to_owned())
        .map_err(|source| SecretError {
            channel: channel.to_owned(),
            path: path.display().to_string(),
            source,
        })
}

/// Builds the channels, reading secrets from their files.
pub fn from_config(config: &NotifyConfig) -> Result<Vec<Channel>, SecretError> {
    let mut channels = Vec::new();
    for w in &config.webhook {
        let secret = match (&w.secret, &w.secret_file) {
            (Some(s), _) => s.clone(),
            (None, Some(path)) => read_secret(&w.name, path)?,
            (None, None) => String::new(),
        };
        channels.push(Channel {
            name: w.name.clone(),
            min_severity: w.min_severity,
            target: Target::Webhook {
                url: w.url.clone(),
                secret: secret.into_bytes(),
            },
        });
    }
    for s in &config.slack {
        let url = match (&s.webhook_url, &s.webhook_url_file) {
            (Some(u), _) => u.clone(),
            (None, Some(path)) => read_secret(&s.name, path)?,
            (None, None) => String::new(),
        };
        channels.push(Channel {
            name: s.name.clone(),
            min_severity: s.min_severity,
            target: Target::Slack { url },
        });
    }
    for p in &config.pagerduty {
        let routing_key = match (&p.routing_key, &p.routing_key_file) {
            (Some(k), _) => k.clone(),
            (None, Some(path)) => read_secret(&p.name, path)?,
            (None, None) => String::new(),
        };
        channels.push(Channel {
            name: p.name.clone(),
            min_severity: p.min_severity,
            target: Target::PagerDuty {
                url: p.url.clone(),
                routing_key,
            },
        });
    }
    Ok(channels)
}

/// `sha256=<hex>` over `"{timestamp}.{body}"`: receivers recompute it with the
/// shared secret and reject stale timestamps to stop replays.
pub fn signature(secret: &[u8], timestamp_s: i64, body: &str) -> String {
    // HMAC takes keys of any length, so this cannot fail.
    let mut mac = match Hmac::<Sha256>::new_from_slice(secret) {
        Ok(mac) => mac,
        Err(_) => return String::new(),
    };
    mac.update(timestamp_s.to_string().as_bytes());
    mac.update(b".");
    mac.update(body.as_bytes());
    let digest = mac.finalize().into_bytes();
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256={hex}")
}

/// The client every notifier sends with: a receiver that hangs costs a
/// delivery attempt, not the task.
pub(super) fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .user_agent(concat!("headroom/", env!("CARGO_PKG_VERSION")))
        .build()
        .unwrap_or_default()
}

#[derive(Debug, Clone)]
pub struct Sender {
    http: reqwest::Client,
    channels: HashMap<String, Channel>,
}

impl Sender {
    pub fn new(channels: Vec<Channel>) -> Self {
        let http = http_client();
        Self {
            http,
            channels: channels.into_iter().map(|c| (c.name.clone(), c)).collect(),
        }
    }

    /// Delivers notifications of one channel; any 2xx answer counts. Slack
    /// gets them as one message, a webhook one request each.
    pub async fn send_group(&self, items: &[&OutboxItem], now_ms: i64) -> Result<(), String> {
        let Some(first) = items.first() else {
            return Ok(());
        };
        let channel = self
            .channels
            .get(&first.channel)
            .ok_or_else(|| format!("channel {:?} is no longer configured", first.channel))?;
        match &channel.target {
            Target::Slack { .. } => {
                let payloads: Vec<&str> = items.iter().map(|i| i.payload.as_str()).collect();
                let merged = OutboxItem {
                    payload: super::render::merge_slack(&payloads),
                    ..(*first).clone()
                };
                self.send(&merged, now_ms).await
            }
            Target::Webhook { .. } | Target::PagerDuty { .. } => {
                for item in items {
                    self.send(item, now_ms).await?;
                }
                Ok(())
            }
        }
    }

    /// Delivers one notification; any 2xx answer counts.
    pub async fn send(&self, item: &OutboxItem, now_ms: i64) -> Result<(), String> {
        let channel = self
            .channels
            .get(&item.channel)
            .ok_or_else(|| format!("channel {:?} is no longer configured", item.channel))?;
        let request = match &channel.target {
            Target::Webhook { url, secret } => {
                let ts = now_ms / 1000;
                self.http
                    .post(url)
                    .header("content-type", "application/json")
                    .header("x-headroom-timestamp", ts.to_string())
                    .header("x-headroom-signature", signature(secret, ts, &item.payload))
                    .header("idempotency-key", &item.idempotency_key)
                    .body(item.payload.clone())
            }
            Target::Slack { url } => self
                .http
                .post(url)
                .header("content-type", "application/json")
                .body(item.payload.clone()),
            Target::PagerDuty { url, routing_key } => {
                let mut body: serde_json::Value = serde_json::from_str(&item.payload)
                    .map_err(|e| format!("stored PagerDuty event is not JSON: {e}"))?;
                let Some(event) = body.as_object_mut() else {
                    return Err("stored PagerDuty event is not a JSON object".into());
                };
                event.insert("routing_key".into(), routing_key.as_str().into());
                self.http.post(url).json(&body)
            }
        };
        // reqwest errors can carry the URL, which may be a secret (Slack).
        let response = request
            .send()
            .await
            .map_err(|e| format!("request failed: {}", e.without_url()))?;
        if response.status().is_success() {
            Ok(())
        } else {
            Err(format!("receiver answered HTTP {}", response.status()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_matches_a_known_hmac() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        let mut mac = Hmac::<Sha256>::new_from_slice(b"Jefe").unwrap();
        mac.update(b"what do ya want for nothing?");
        let hex: String = mac
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        // Ours signs "{ts}.{body}".
        let sig = signature(b"Jefe", 12, "3");
        let mut mac = Hmac::<Sha256>::new_from_slice(b"Jefe").unwrap();
        mac.update(b"12.3");
        let want: String = mac
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(sig, format!("sha256={want}"));
    }
}
