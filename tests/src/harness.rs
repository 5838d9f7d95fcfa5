//! A collector running in-process on loopback ports chosen by the OS.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use headroom_collector::Collector;
use headroom_collector::server::ServeError;
use headroom_rules::config::RulesConfig;
use headroom_store::Store;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

#[derive(Debug)]
pub struct RunningCollector {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), ServeError>>,
}

impl RunningCollector {
    pub async fn start(store: Arc<dyn Store>) -> Self {
        let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::start_on(store, grpc).await
    }

    /// Starts on an already bound gRPC listener (to come up on a known port).
    pub async fn start_on(store: Arc<dyn Store>, grpc: TcpListener) -> Self {
        Self::run(Collector::builder(store).build().await.unwrap(), grpc).await
    }

    /// A collector on a fresh SQLite file in `dir`, running the built-in
    /// rules with no notification channels.
    pub async fn start_sqlite_with_default_rules(dir: &std::path::Path) -> Self {
        Self::start_sqlite_with_rules(dir, RulesConfig::default()).await
    }

    /// A collector on a fresh SQLite file in `dir`, running `rules`.
    pub async fn start_sqlite_with_rules(dir: &std::path::Path, rules: RulesConfig) -> Self {
        let url = format!("sqlite://{}", dir.join("headroom.db").display());
        let store: Arc<dyn Store> = headroom_store::connect(&url).await.unwrap();
        let collector = Collector::builder(store)
            .rules(rules)
            .build()
            .await
            .unwrap();
        Self::start_collector(collector).await
    }

    /// Runs a collector built by the caller (rules, clock) on a free port.
    pub async fn start_collector(collector: Collector) -> Self {
        let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::run(collector, grpc).await
    }

    /// A collector that tells the others sharing its database to reach it
    /// at its HTTP address (`[cluster] advertise_url`), serving once it
    /// answers `/healthz` (linked to the others by then).
    pub async fn start_advertised(store: Arc<dyn Store>) -> Self {
        let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", http.local_addr().unwrap());
        let collector = Collector::builder(store)
            .advertise_url(url)
            .build()
            .await
            .unwrap();
        let running = Self::run_on(collector, grpc, http).await;
        reqwest::get(running.api("/healthz")).await.unwrap();
        running
    }

    async fn run(collector: Collector, grpc: TcpListener) -> Self {
        let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::run_on(collector, grpc, http).await
    }

    async fn run_on(collector: Collector, grpc: TcpListener, http: TcpListener) -> Self {
        let grpc_addr = grpc.local_addr().unwrap();
        let http_addr = http.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(collector.serve(grpc, http, async move {
            let _ = stopped.await;
        }));
        Self {
            grpc_addr,
            http_addr,
            stop,
            task,
        }
    }

    pub fn grpc_url(&self) -> String {
        format!("http://{}", self.grpc_addr)
    }

    pub fn api(&self, path: &str) -> String {
        format!("http://{}{path}", self.http_addr)
    }

    pub async fn get_json(&self, path: &str) -> serde_json::Value {
        let response = reqwest::get(self.api(path)).await.unwrap();
        assert!(
            response.status().is_success(),
            "GET {path}: {}",
            response.status()
        );
        response.json().await.unwrap()
    }

    /// The value of `name_and_labels` on this collector's `/metrics`.
    pub async fn metric(&self, name_and_labels: &str) -> f64 {
        scrape_metric(self.http_addr, name_and_labels).await
    }

    /// Waits until some device shows a current sample: an agent got through.
    pub async fn wait_for_samples(&self, what: &str) {
        eventually(what, Duration::from_secs(30), || async {
            let gpus = self.get_json("/api/v1/gpus").await;
            gpus.as_array()
                .is_some_and(|list| list.iter().any(|d| !d["latest"].is_null()))
                .then_some(())
        })
        .await;
    }

    pub async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap().unwrap();
    }

    /// Ends the collector abruptly, as a crash would: no graceful shutdown.
    pub async fn kill(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

/// The value of `name_and_labels` (as exposed: `name{label="value"}`) on
/// the `/metrics` of the collector whose HTTP port is `http`.
pub async fn scrape_metric(http: SocketAddr, name_and_labels: &str) -> f64 {
    let text = reqwest::get(format!("http://{http}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|line| line.strip_prefix(name_and_labels)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("{name_and_labels} missing from /metrics:\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// A binary or library cargo built in this profile's directory (`cargo test
/// --workspace` builds every member's binaries).
/// A loopback address no one listens on now, for a child process to bind.
pub fn free_loopback_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("binding a loopback port")
}

pub fn built(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .and_then(std::path::Path::parent)
        .unwrap()
        .join(name);
    assert!(
        path.exists(),
        "{} is missing: run the tests with `cargo test --workspace`",
        path.display()
    );
    path
}

/// Polls `check` until it returns `Some`, or panics naming `what` after `limit`.
pub async fn eventually<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Settings for an in-process agent serving `node` of a scenario to
/// `collector_url`: memory outbox, no token, no TLS, no metrics, fast
/// cadence. Tests change what they test with struct update syntax.
pub fn sim_agent_settings(collector_url: String, node: &str) -> headroom_agent::AgentSettings {
    headroom_agent::AgentSettings {
        collector_url,
        node: node.to_owned(),
        token: None,
        tls: None,
        spool: None,
        boot_id: format!("test-run-{node}"),
        poll_interval: Duration::from_millis(50),
        sample_interval: Duration::from_millis(200),
        max_pending_batches: 1000,
        flush_above: 1.5,
        metrics_listen: None,
        allocator_socket: None,
        dcgm_metric_names: false,
    }
}

/// An in-process agent serving `node` of the scenario `toml` to `collector`,
/// with [`sim_agent_settings`].
pub fn start_sim_agent(
    collector: &RunningCollector,
    toml: &str,
    node: &str,
) -> headroom_agent::AgentHandle {
    let scenario = headroom_sim::Scenario::from_toml_str(toml).unwrap();
    headroom_agent::start(
        sim_agent_settings(collector.grpc_url(), node),
        Box::new(headroom_agent::source::SimSource::new(&scenario, node).unwrap()),
    )
    .unwrap()
}

/// A child process that is killed and reaped when dropped, so a test that
/// fails half-way leaves nothing running.
#[derive(Debug)]
pub struct KillOnDrop(pub std::process::Child);

impl KillOnDrop {
    /// Starts a tool a test runs beside Headroom (Prometheus, Alertmanager,
    /// from Debian's `package`), its output discarded. Where it is missing
    /// the test skips, naming `test` and the package (and fails under CI,
    /// which installs it).
    pub fn tool(command: &mut std::process::Command, test: &str, package: &str) -> Option<Self> {
        let program = command.get_program().to_string_lossy().into_owned();
        match command
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
        {
            Ok(child) => Some(Self(child)),
            Err(e) => {
                crate::skip_or_fail_under_ci(
                    test,
                    format!("{program} (Debian's {package}) is missing: {e}"),
                );
                None
            }
        }
    }

    /// Kills it now (SIGKILL), as a crash would.
    pub fn kill(self) {
        drop(self);
    }

    /// Whether it has not exited.
    pub fn is_running(&mut self) -> bool {
        matches!(self.0.try_wait(), Ok(None))
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
