//! Pods' labels from the Kubernetes API server, for owner routes: a pod
//! labelled `team: vision` pages team vision. The cgroup path gives a pod's
//! uid only and the kubelet's directories its namespace and name; labels
//! live in the API server alone. The agent lists this node's pods with its
//! service account (`get`/`list` on pods, `deploy/kubernetes/`) every
//! [`REFRESH`] and keeps only the label keys it was told to forward
//! (`pod_labels`), so no other label leaves the node.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::Deserialize;
use tokio::sync::watch;

/// How often the node's pods are listed again. A new pod's processes go
/// without its labels until then (their owner is read again every 5 s).
pub const REFRESH: Duration = Duration::from_secs(30);

/// Where a pod's service account credentials are mounted.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// One pod's forwarded labels, sorted by key.
pub type Labels = Arc<[(String, String)]>;

/// The forwarded labels of this node's pods, by pod uid.
#[derive(Debug, Default)]
pub struct PodLabels {
    by_uid: RwLock<HashMap<String, Labels>>,
}

impl PodLabels {
    /// The pod's forwarded labels, sorted by key; empty for a pod not (yet)
    /// listed or labelled with none of them.
    pub fn of(&self, pod_uid: &str) -> Labels {
        self.by_uid
            .read()
            .ok()
            .and_then(|m| m.get(pod_uid).cloned())
            .unwrap_or_else(|| Arc::from([]))
    }

    /// Puts in what the API server said last: each pod's forwarded labels.
    pub fn replace(&self, pods: HashMap<String, Labels>) {
        if let Ok(mut m) = self.by_uid.write() {
            *m = pods;
        }
    }
}

/// How to reach the API server.
#[derive(Debug, Clone)]
pub struct ApiServer {
    /// `https://host:port`; in a pod, from `KUBERNETES_SERVICE_HOST` and
    /// `_PORT`.
    pub url: String,
    /// Holds `token` (re-read on every request: projected tokens rotate)
    /// and `ca.crt`.
    pub service_account_dir: PathBuf,
    pub node: String,
    /// The label keys forwarded; every other label is dropped here.
    pub keys: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a PEM certificate: {source}")]
    Certificate {
        path: PathBuf,
        source: reqwest::Error,
    },
    #[error("listing pods on {url}: {message}")]
    Request { url: String, message: String },
}

impl ApiServer {
    /// The API server as a pod sees it, when this agent runs in one.
    pub fn in_cluster_url() -> Option<String> {
        let host = std::env::var("KUBERNETES_SERVICE_HOST").ok()?;
        let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
        // An IPv6 service address needs brackets in a URL.
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host
        };
        Some(format!("https://{host}:{port}"))
    }

    fn client(&self) -> Result<reqwest::Client, ApiError> {
        let mut builder = reqwest::Client::builder().timeout(Duration::from_secs(10));
        let ca = self.service_account_dir.join("ca.crt");
        if self.url.starts_with("https://") {
            let pem = read(&ca)?;
            let certificate =
                reqwest::Certificate::from_pem(&pem).map_err(|source| ApiError::Certificate {
                    path: ca.clone(),
                    source,
                })?;
            builder = builder.add_root_certificate(certificate);
        }
        builder.build().map_err(|e| ApiError::Request {
            url: self.url.clone(),
            message: e.to_string(),
        })
    }

    /// One listing of this node's pods: uid → forwarded labels.
    pub async fn list(
        &self,
        client: &reqwest::Client,
    ) -> Result<HashMap<String, Labels>, ApiError> {
        let token_path = self.service_account_dir.join("token");
        let token = String::from_utf8_lossy(&read(&token_path)?)
            .trim()
            .to_owned();
        let url = format!("{}/api/v1/pods", self.url.trim_end_matches('/'));
        let failed = |message: String| ApiError::Request {
            url: url.clone(),
            message,
        };
        let response = client
            .get(&url)
            .query(&[("fieldSelector", format!("spec.nodeName={}", self.node))])
            .bearer_auth(token)
            .send()
            .await
            .map_err(|e| failed(e.without_url().to_string()))?;
        let status = response.status();
        if !status.is_success() {
            let hint = if status == reqwest::StatusCode::FORBIDDEN {
                " (the agent's service account needs get and list on pods: deploy/kubernetes/agent-rbac.yaml)"
            } else {
                ""
            };
            return Err(failed(format!("HTTP {status}{hint}")));
        }
        let pods: PodList = response
            .json()
            .await
            .map_err(|e| failed(format!("not a pod list: {}", e.without_url())))?;
        Ok(forwarded(pods, &self.keys))
    }
}

fn read(path: &Path) -> Result<Vec<u8>, ApiError> {
    std::fs::read(path).map_err(|source| ApiError::Read {
        path: path.to_owned(),
        source,
    })
}

#[derive(Debug, Deserialize)]
struct PodList {
    #[serde(default)]
    items: Vec<Pod>,
}

#[derive(Debug, Deserialize)]
struct Pod {
    metadata: PodMetadata,
}

#[derive(Debug, Deserialize)]
struct PodMetadata {
    uid: String,
    #[serde(default)]
    labels: HashMap<String, String>,
}

/// Keeps, per pod, the labels among `keys`.
fn forwarded(pods: PodList, keys: &[String]) -> HashMap<String, Labels> {
    pods.items
        .into_iter()
        .map(|pod| {
            let mut kept: Vec<(String, String)> = pod
                .metadata
                .labels
                .into_iter()
                .filter(|(k, _)| keys.contains(k))
                .collect();
            kept.sort();
            (pod.metadata.uid, Arc::from(kept))
        })
        .collect()
}

/// Lists the node's pods every [`REFRESH`] until `stop`; a failed listing
/// keeps the last labels and is logged once until one succeeds again.
pub async fn keep_pod_labels(
    api: ApiServer,
    labels: Arc<PodLabels>,
    mut stop: watch::Receiver<bool>,
) {
    let mut failing = false;
    let mut client = None;
    loop {
        let result = match &client {
            Some(c) => api.list(c).await,
            None => match api.client() {
                Ok(c) => {
                    let listed = api.list(&c).await;
                    client = Some(c);
                    listed
                }
                Err(e) => Err(e),
            },
        };
        match result {
            Ok(pods) => {
                if failing {
                    tracing::info!(pods = pods.len(), "pod labels read again");
                }
                failing = false;
                labels.replace(pods);
            }
            Err(error) => {
                if !failing {
                    tracing::warn!(%error, "cannot read pod labels; routes on them wait");
                }
                failing = true;
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(REFRESH) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_forwarded_keys_leave_the_node() {
        let pods: PodList = serde_json::from_str(
            r#"{"kind": "PodList", "items": [
                {"metadata": {"uid": "u1", "name": "a", "labels": {"team": "vision", "secret-ish": "x", "app": "trainer"}}},
                {"metadata": {"uid": "u2", "name": "b"}}
            ]}"#,
        )
        .unwrap();
        let map = forwarded(pods, &["team".into(), "app".into()]);
        assert_eq!(
            &*map["u1"],
            &[
                ("app".to_owned(), "trainer".to_owned()),
                ("team".to_owned(), "vision".to_owned())
            ]
        );
        assert!(map["u2"].is_empty());
        let labels = PodLabels::default();
        labels.replace(map);
        assert_eq!(labels.of("u1").len(), 2);
        assert!(labels.of("unknown").is_empty());
    }

    #[tokio::test]
    async fn lists_the_nodes_pods_with_the_service_accounts_token() {
        use axum::extract::Query;
        use axum::http::HeaderMap;
        let app = axum::Router::new().route(
            "/api/v1/pods",
            axum::routing::get(
                |Query(q): Query<HashMap<String, String>>, headers: HeaderMap| async move {
                    let authorized = headers
                        .get("authorization")
                        .is_some_and(|v| v == "Bearer t0ken");
                    if !authorized
                        || q.get("fieldSelector").map(String::as_str)
                            != Some("spec.nodeName=gpu-a01")
                    {
                        return (axum::http::StatusCode::FORBIDDEN, String::new());
                    }
                    (
                        axum::http::StatusCode::OK,
                        r#"{"items": [{"metadata": {"uid": "u1", "labels": {"team": "vision"}}}]}"#
                            .to_owned(),
                    )
                },
            ),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "t0ken\n").unwrap();
        let api = ApiServer {
            url: format!("http://{addr}"),
            service_account_dir: dir.path().to_owned(),
            node: "gpu-a01".into(),
            keys: vec!["team".into()],
        };
        let client = api.client().unwrap();
        let pods = api.list(&client).await.unwrap();
        assert_eq!(&*pods["u1"], &[("team".to_owned(), "vision".to_owned())]);

        let other_node = ApiServer {
            node: "gpu-b02".into(),
            ..api.clone()
        };
        let error = other_node.list(&client).await.unwrap_err().to_string();
        assert!(
            error.contains("403") && error.contains("get and list on pods"),
            "{error}"
        );
        let no_token = ApiServer {
            service_account_dir: dir.path().join("missing"),
            ..api
        };
        let error = no_token.list(&client).await.unwrap_err().to_string();
        assert!(error.contains("missing/token"), "{error}");
    }
}
