//! Delivers the outbox. A notification is marked delivered only after the
//! receiver said yes; until then it is retried with growing delays, across
//! restarts, and the idempotency key lets a receiver drop the rare duplicate
//! (a crash between the receiver's yes and our mark).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::Alerting;

/// How long a claimed notification is ours before another collector may
/// retry it: longer than one delivery attempt can take.
const LEASE_MS: i64 = 60_000;
const MAX_BACKOFF_MS: i64 = 5 * 60_000;

fn retry_delay_ms(attempts: i64) -> i64 {
    let exp = u32::try_from(attempts.clamp(1, 20) - 1).unwrap_or(0);
    (1000i64.saturating_mul(1i64 << exp.min(16))).min(MAX_BACKOFF_MS)
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
        for item in &items {
            let Some(sender) = &sender else { break };
            let result = sender.send(item, alerting.clock.now_ms()).await;
            let now = alerting.clock.now_ms();
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

    #[test]
    fn retries_back_off_to_five_minutes() {
        assert_eq!(retry_delay_ms(1), 1000);
        assert_eq!(retry_delay_ms(2), 2000);
        assert_eq!(retry_delay_ms(4), 8000);
        assert_eq!(retry_delay_ms(30), MAX_BACKOFF_MS);
    }
}
