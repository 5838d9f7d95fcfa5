//! `headroom-collector job-report ID`: a job's memory report, from a
//! running collector's API, as text for its owner.

use std::time::Duration;

use anyhow::Context;
use headroom_collector::job_report_text::render;

pub async fn run(base: &str, token: Option<&str>, id: &str) -> anyhow::Result<()> {
    let mut url = reqwest::Url::parse(base.trim_end_matches('/'))
        .with_context(|| format!("{base:?} is not a URL"))?;
    url.path_segments_mut()
        .map_err(|()| anyhow::anyhow!("{base:?} cannot have a path"))?
        .pop_if_empty()
        .extend(["api", "v1", "jobs", id, "report"]);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    let report = crate::status::get(&client, url.as_str(), token).await?;
    print!("{}", render(&report));
    Ok(())
}
