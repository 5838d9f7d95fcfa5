//! Delivers the outbox. A notification is marked delivered only after the
//! receiver said yes; until then it is retried with growing delays, across
//! restarts, and the idempotency key lets a receiver drop the rare duplicate
//! (a crash between the receiver's yes and our mark).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::{mpsc, watch};

use super::Alerting;
use super::channels::Sender;
use crate::metrics::AlertStage;
use headroom_store::alerts::OutboxItem;

/// How long a claimed notification is ours before another collector may
/// retry it: longer than one delivery attempt can take.
const LEASE_MS: i64 = 60_000;
const MAX_BACKOFF_MS: i64 = 5 * 60_000;
/// Notifications claimed at once: a burst of alerts across a fleet goes out
/// in one round, not in rounds of a few. Even if every receiver times out
/// (10 s), a round of `CLAIM / LANES_AT_ONCE` requests per lane ends
/// within the lease, so no other collector sends them meanwhile.
const CLAIM: i64 = 128;
const CLAIM_LEN: usize = CLAIM as usize;
/// Lanes (alerts) sent side by side, each one HTTP request at a time; the
/// marks of what was delivered are written together, apart from them.
const LANES_AT_ONCE: usize = 32;

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

/// Groups that must go one after another: those announcing the same alert,
/// so a receiver hears an alert fire before it hears it resolve. Lanes go
/// side by side, so a burst of alerts (a job spiking on every node at
/// once) is not sent one round trip at a time, and a slow receiver holds
/// up only its own notifications.
fn lanes(groups: Vec<Vec<&OutboxItem>>) -> Vec<Vec<Vec<&OutboxItem>>> {
    let mut lanes: Vec<Vec<Vec<&OutboxItem>>> = Vec::new();
    // The lane each alert's groups went to; a job report (alert 0) is
    // alone.
    let mut lane_of: HashMap<i64, usize> = HashMap::new();
    for group in groups {
        let mut touched: Vec<usize> = group
            .iter()
            .filter(|i| i.alert_id != 0)
            .filter_map(|i| lane_of.get(&i.alert_id).copied())
            .collect();
        touched.sort_unstable();
        touched.dedup();
        // A group of several alerts joins their lanes into the first: each
        // lane's order is kept, the later ones after it.
        let lane = match touched.split_first() {
            Some((&first, rest)) => {
                for &other in rest.iter().rev() {
                    let moved = std::mem::take(&mut lanes[other]);
                    lanes[first].extend(moved);
                    for at in lane_of.values_mut() {
                        if *at == other {
                            *at = first;
                        }
                    }
                }
                first
            }
            None => {
                lanes.push(Vec::new());
                lanes.len() - 1
            }
        };
        for item in &group {
            if item.alert_id != 0 {
                lane_of.insert(item.alert_id, lane);
            }
        }
        lanes[lane].push(group);
    }
    lanes.retain(|lane| !lane.is_empty());
    lanes
}

pub(super) async fn deliver(alerting: Arc<Alerting>, mut stop: watch::Receiver<bool>) {
    loop {
        let now = alerting.clock.now_ms();
        let mut items = match alerting
            .store
            .claim_notifications(now, LEASE_MS, CLAIM)
            .await
        {
            Ok(items) => items,
            Err(error) => {
                tracing::error!(%error, "reading the notification outbox failed");
                Vec::new()
            }
        };
        // The order they were written in; a database may return the
        // claimed rows in any order.
        items.sort_unstable_by_key(|i| i.id);
        let sender = alerting.sender.read().map(|s| s.clone()).ok();
        if let Some(sender) = sender {
            let (delivered, marks) = mpsc::unbounded_channel();
            let send = async {
                futures::stream::iter(lanes(groups(&items)))
                    .for_each_concurrent(LANES_AT_ONCE, |lane| {
                        let (alerting, sender, delivered) = (&alerting, &sender, delivered.clone());
                        async move {
                            for group in lane {
                                deliver_group(alerting, sender, &group, &delivered).await;
                            }
                        }
                    })
                    .await;
                drop(delivered);
            };
            tokio::join!(send, record_deliveries(&alerting, marks));
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

/// Sends one group; hands its items to `delivered` on a yes, records the
/// failure on each otherwise.
async fn deliver_group(
    alerting: &Alerting,
    sender: &Sender,
    group: &[&OutboxItem],
    delivered: &mpsc::UnboundedSender<i64>,
) {
    let result = sender.send_group(group, alerting.clock.now_ms()).await;
    let now = alerting.clock.now_ms();
    for item in group {
        match &result {
            Ok(()) => {
                tracing::info!(channel = %item.channel, key = %item.idempotency_key, "notification delivered");
                if item.alert_id != 0 {
                    alerting
                        .metrics
                        .alert_reached(AlertStage::Delivered, now - item.created_at_ms);
                }
                // The receiver only ends when this round does.
                let _ = delivered.send(item.id);
            }
            Err(error) => {
                let delay = retry_delay_ms(item.attempts);
                tracing::warn!(channel = %item.channel, attempts = item.attempts, retry_in_ms = delay,
                    %error, "notification failed");
                if let Err(error) = alerting
                    .store
                    .notification_failed(item.id, now + delay, error)
                    .await
                {
                    tracing::error!(%error, "recording a failed delivery failed; it will be retried after its lease");
                }
            }
        }
    }
}

/// Marks notifications delivered as the receivers say yes: whatever came
/// in while the last write ran goes in the next, so a burst of a hundred
/// costs a few writes, not a hundred, and none waits for the round to end.
async fn record_deliveries(alerting: &Alerting, mut delivered: mpsc::UnboundedReceiver<i64>) {
    let mut ids = Vec::new();
    while delivered.recv_many(&mut ids, CLAIM_LEN).await > 0 {
        if let Err(error) = alerting
            .store
            .notifications_delivered(&ids, alerting.clock.now_ms())
            .await
        {
            tracing::error!(%error, count = ids.len(), "recording deliveries failed; they will be sent again after their lease, with the same idempotency keys");
        }
        ids.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(id: i64, channel: &str, group: &str) -> OutboxItem {
        OutboxItem {
            id,
            alert_id: id,
            created_at_ms: 0,
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

    fn with_alert(mut item: OutboxItem, alert_id: i64) -> OutboxItem {
        item.alert_id = alert_id;
        item
    }

    fn lane_ids(items: &[OutboxItem]) -> Vec<Vec<i64>> {
        lanes(groups(items))
            .iter()
            .map(|lane| lane.iter().flatten().map(|i| i.id).collect())
            .collect()
    }

    #[test]
    fn different_alerts_go_side_by_side_and_one_alerts_notifications_in_order() {
        let items = vec![
            with_alert(item(1, "hook", ""), 10),
            with_alert(item(2, "hook", ""), 11),
            // Alert 10 resolves after it fired: after its firing, in its lane.
            with_alert(item(3, "hook", ""), 10),
            with_alert(item(4, "pager", ""), 12),
            // Job reports have no alert; each goes alone.
            with_alert(item(5, "hook", ""), 0),
            with_alert(item(6, "hook", ""), 0),
        ];
        assert_eq!(
            lane_ids(&items),
            vec![vec![1, 3], vec![2], vec![4], vec![5], vec![6]]
        );
    }

    #[test]
    fn a_group_of_several_alerts_joins_their_lanes_in_order() {
        let items = vec![
            with_alert(item(1, "hook", ""), 10),
            with_alert(item(2, "hook", ""), 11),
            // One Slack message about both alerts: after both of theirs.
            with_alert(item(3, "slack", "n1"), 10),
            with_alert(item(4, "slack", "n1"), 11),
            with_alert(item(5, "hook", ""), 11),
        ];
        assert_eq!(lane_ids(&items), vec![vec![1, 2, 3, 4, 5]]);
    }

    #[test]
    fn retries_back_off_to_five_minutes() {
        assert_eq!(retry_delay_ms(1), 1000);
        assert_eq!(retry_delay_ms(2), 2000);
        assert_eq!(retry_delay_ms(4), 8000);
        assert_eq!(retry_delay_ms(30), MAX_BACKOFF_MS);
    }
}
