//! Delivers the outbox. A notification is marked delivered only after the
//! receiver said yes; until then it is retried with growing delays, across
//! restarts, and the idempotency key lets a receiver drop the rare duplicate
//! (a crash between the receiver's yes and our mark).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::Alerting;
use headroom_store::alerts::OutboxItem;

/// How long a claimed notification is ours before another collector may
/// retry it: longer than one delivery attempt can take.
const LEASE_MS: i64 = 60_000;
const MAX_BACKOFF_MS: i64 = 5 * 60_000;

fn retry_delay_ms(attempts: i64) -> i64 {
    let exp = u32::try_from(attempts.clamp(1, 20) - 1).unwrap_or(0);
    (1000i64.saturating_mul(1i64 << exp.min(16))).min(MAX_BACKOFF_MS)
}

/// Items of one channel and non-empty group key travel together; every
/// other item alone. Order of first appearance is kept.
fn groups(items: &[OutboxItem]) -> Vec<Vec<&OutboxItem>> {
    let mut out: Vec<Vec<&OutboxItem>> = Vec::new();
    for item in items {
        let joined = !item.group_key.is_empty()
            && out.iter_mut().any(|g| {
                let head = g[0];
                if head.channel == item.channel && head.group_key == item.group_key {
                    g.push(item);
                    true
                } else {
                    false
                }
            });
        if !joined {
            out.push(vec![item]);
        }
    }
    out
}

pub(super) async fn deliver(alerting: Arc<Alerting>, mut stop: watch::Receiver<bool>) {
    loop {
        let now = alerting.clock.now_ms();
        let items = match alerting.store.claim_notifications(now, LEASE_MS, 20).await {
            Ok(items) => items,
            Err(error) => {
                tracing::error!(%error, "reading the notification outbox failed");
                Vec::new()
            }
        };
        let sender = alerting.sender.read().map(|s| s.clone()).ok();
        for group in groups(&items) {
            let Some(sender) = &sender else { break };
            let result = sender.send_group(&group, alerting.clock.now_ms()).await;
            let now = alerting.clock.now_ms();
            for item in group {
                let stored = match &result {
                    Ok(()) => {
                        tracing::info!(channel = %item.channel, key = %item.idempotency_key, "notification delivered");
                        alerting.store.notification_delivered(item.id, now).await
                    }
                    Err(error) => {
                        let delay = retry_delay_ms(item.attempts);
                        tracing::warn!(channel = %item.channel, attempts = item.attempts, retry_in_ms = delay,
                            %error, "notification failed");
                        alerting
                            .store
                            .notification_failed(item.id, now + delay, error)
                            .await
                    }
                };
                if let Err(error) = stored {
                    tracing::error!(%error, "recording a delivery failed; it will be retried after its lease");
                }
            }
        }
        if items.is_empty() {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = alerting.wake_outbox.notified() => {}
                _ = super::stopped(&mut stop) => return,
            }
        } else if *stop.borrow() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(id: i64, channel: &str, group: &str) -> OutboxItem {
        OutboxItem {
            id,
            channel: channel.into(),
            idempotency_key: id.to_string(),
            payload: String::new(),
            attempts: 1,
            group_key: group.into(),
        }
    }

    #[test]
    fn only_same_channel_same_group_items_travel_together() {
        let items = vec![
            item(1, "slack", "n1"),
            item(2, "hook", ""),
            item(3, "slack", "n2"),
            item(4, "slack", "n1"),
            item(5, "hook", ""),
        ];
        let ids: Vec<Vec<i64>> = groups(&items)
            .iter()
            .map(|g| g.iter().map(|i| i.id).collect())
            .collect();
        assert_eq!(ids, vec![vec![1, 4], vec![2], vec![3], vec![5]]);
    }

    #[test]
    fn retries_back_off_to_five_minutes() {
        assert_eq!(retry_delay_ms(1), 1000);
        assert_eq!(retry_delay_ms(2), 2000);
        assert_eq!(retry_delay_ms(4), 8000);
        assert_eq!(retry_delay_ms(30), MAX_BACKOFF_MS);
    }
}
