//! `headroom-collector status`: the fleet's headroom and the firing alerts,
//! read from a collector's JSON API and printed as a table.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Context;
use serde_json::Value;

const GIB: f64 = (1u64 << 30) as f64;
/// `GET /api/v1/fleet`'s count of fullest devices when none is asked for,
/// and the most it lists.
const FULLEST_DEFAULT: usize = 100;
const FULLEST_MAX: usize = 1_000;

fn gib(v: &Value) -> String {
    v.as_i64()
        .map_or("—".to_owned(), |b| format!("{:.1} GiB", b as f64 / GIB))
}

/// The fleet's totals, then the first `listed` of its fullest devices as
/// `/api/v1/fleet` lists them (least headroom first: headroom is what runs
/// out), then the firing alerts.
pub fn render(fleet: &Value, alerts: &Value, listed: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} nodes, {} GPUs ({} MIG instances): {} of {} used; {} GPUs below 10 % headroom at their peak{}",
        fleet["nodes"],
        fleet["gpus"],
        fleet["mig_instances"],
        gib(&fleet["memory_used_bytes"]),
        gib(&fleet["memory_total_bytes"]),
        fleet["gpus_low_headroom"],
        match fleet["gpus_without_data"].as_i64() {
            Some(n) if n > 0 => format!("; {n} without data yet"),
            _ => String::new(),
        }
    );
    let _ = writeln!(
        out,
        "\n{:<16} {:<10} {:<24} {:>10} {:>10} {:>10} {:>18}",
        "NODE", "DEVICE", "MODEL", "USED", "PEAK", "TOTAL", "HEADROOM"
    );
    let rows = fleet["fullest"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    let rows = &rows[..listed.min(rows.len())];
    for d in rows {
        let device = match d["mig_profile"].as_str() {
            Some(profile) => format!("{} {}", d["index"], profile),
            None => format!("{}", d["index"]),
        };
        let latest = &d["latest"];
        let headroom = match latest["headroom_pct"].as_f64() {
            Some(pct) => format!("{} {pct:>5.1} %", gib(&latest["headroom_bytes"])),
            None => "no data".to_owned(),
        };
        let model: String = d["name"].as_str().unwrap_or("").chars().take(24).collect();
        let _ = writeln!(
            out,
            "{:<16} {:<10} {:<24} {:>10} {:>10} {:>10} {:>18}",
            d["node"].as_str().unwrap_or(""),
            device,
            model,
            gib(&latest["memory_used_bytes"]),
            gib(&latest["memory_used_max_bytes"]),
            gib(&d["memory_total_bytes"]),
            headroom
        );
    }
    let with_data = fleet["devices_with_data"].as_u64().unwrap_or(0);
    if (rows.len() as u64) < with_data {
        let more = if rows.len() < FULLEST_MAX {
            "; --fullest N lists more"
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "({} of the fleet's {with_data} devices with data{more})",
            rows.len()
        );
    }
    let firing: Vec<&Value> = alerts
        .as_array()
        .map(|a| a.iter().filter(|a| a["state"] == "firing").collect())
        .unwrap_or_default();
    let _ = writeln!(out, "\nFiring alerts: {}", firing.len());
    for a in firing {
        let _ = writeln!(
            out,
            "  {:<8} {:<16} {}{}",
            a["severity"].as_str().unwrap_or(""),
            a["rule"].as_str().unwrap_or(""),
            a["summary"].as_str().unwrap_or(""),
            a["acknowledged_by"]
                .as_str()
                .map(|by| format!(" [ack {by}]"))
                .unwrap_or_default()
        );
    }
    out
}

/// A GET of the collector's API, with the collector's own words on a refusal.
pub(crate) async fn get(
    client: &reqwest::Client,
    url: &str,
    token: Option<&str>,
) -> anyhow::Result<Value> {
    let mut request = client.get(url);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request
        .send()
        .await
        .with_context(|| format!("cannot reach the collector at {url}"))?;
    let status = response.status();
    if status == reqwest::StatusCode::UNAUTHORIZED {
        anyhow::bail!(
            "{url} wants a dashboard token: pass --token or set HEADROOM_TOKEN (`headroom-collector token create --role viewer --name …`)"
        );
    }
    if !status.is_success() {
        let body = response.text().await.unwrap_or_default();
        let said = serde_json::from_str::<Value>(&body)
            .ok()
            .and_then(|v| v["error"].as_str().map(str::to_owned))
            .unwrap_or(body);
        anyhow::bail!("{url} answered HTTP {status}: {}", said.trim());
    }
    response
        .json()
        .await
        .with_context(|| format!("{url} did not answer JSON"))
}

/// `token`: a viewer or admin token, for a collector with `[http_auth]`;
/// `fullest`: how many of the fullest devices to list.
pub async fn run(base: &str, token: Option<&str>, fullest: u16) -> anyhow::Result<()> {
    let base = base.trim_end_matches('/');
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    // Up to the API's default the answer the collector made once per read
    // is asked for, and cut here.
    let url = if usize::from(fullest) <= FULLEST_DEFAULT {
        format!("{base}/api/v1/fleet")
    } else {
        format!("{base}/api/v1/fleet?fullest={fullest}")
    };
    let fleet = get(&client, &url, token).await?;
    let alerts = get(&client, &format!("{base}/api/v1/alerts"), token).await?;
    print!("{}", render(&fleet, &alerts, usize::from(fullest)));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_then_the_fullest_devices_then_firing_alerts() {
        let fleet = serde_json::json!({
            "nodes": 2, "gpus": 3, "mig_instances": 1, "gpus_without_data": 1, "devices_with_data": 3,
            "memory_used_bytes": 94489280512i64, "memory_total_bytes": 257698037760i64,
            "gpus_low_headroom": 1,
            "fullest": [
                {"node": "n2", "index": 3, "name": "A100", "memory_total_bytes": 85899345920i64, "mig_profile": null,
                 "latest": {"memory_used_bytes": 83751862272i64, "memory_used_max_bytes": 84825604096i64,
                            "headroom_bytes": 2147483648i64, "headroom_pct": 2.5}},
                {"node": "n1", "index": 4, "name": "H100", "memory_total_bytes": 42949672960i64, "mig_profile": "3g.40gb",
                 "latest": {"memory_used_bytes": 10737418240i64, "memory_used_max_bytes": 10737418240i64,
                            "headroom_bytes": 32212254720i64, "headroom_pct": 75.0}}
            ]
        });
        let alerts = serde_json::json!([
            {"state": "firing", "severity": "critical", "rule": "watermark", "summary": "GPU 3 on n2 at 97.5 %", "acknowledged_by": "alice"},
            {"state": "pending", "severity": "warning", "rule": "unattributed", "summary": "x"}
        ]);
        let text = render(&fleet, &alerts, 20);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "2 nodes, 3 GPUs (1 MIG instances): 88.0 GiB of 240.0 GiB used; 1 GPUs below 10 % headroom at their peak; 1 without data yet",
            "{text}"
        );
        assert!(lines[2].starts_with("NODE"), "{text}");
        assert!(
            lines[3].starts_with("n2") && lines[3].contains("2.0 GiB   2.5 %"),
            "{text}"
        );
        assert!(
            lines[4].starts_with("n1") && lines[4].contains("4 3g.40gb"),
            "{text}"
        );
        assert!(
            text.contains("(2 of the fleet's 3 devices with data; --fullest N lists more)"),
            "{text}"
        );
        let one = render(&fleet, &alerts, 1);
        assert!(!one.contains("n1 "), "cut to the count asked for: {one}");
        assert!(
            one.contains("(1 of the fleet's 3 devices with data; --fullest N"),
            "{one}"
        );
        assert!(text.contains("Firing alerts: 1"), "{text}");
        assert!(
            text.contains("critical watermark        GPU 3 on n2 at 97.5 % [ack alice]"),
            "{text}"
        );
    }
}
