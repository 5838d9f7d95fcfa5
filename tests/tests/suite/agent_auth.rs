//! Agent tokens over real gRPC: with `require_token`, a call without a token,
//! with an unknown or revoked one, or for another node is refused, counted
//! and logged; a peer that keeps failing is locked out; the agent presents
//! its token; the `token` subcommand enrols, lists and revokes.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use headroom_agent::source::SimSource;
use headroom_agent::{AgentSettings, AgentToken};
use headroom_collector::Collector;
use headroom_collector::ingest::auth::{MAX_FAILURES, REFRESH};
use headroom_proto::v1 as pb;
use headroom_proto::v1::ingest_client::IngestClient;
use headroom_sim::Scenario;
use headroom_store::Store;
use headroom_store::tokens::TokenRole;
use headroom_tests::fixtures::{self, BOOT, NODE, now_ms};
use headroom_tests::harness::{RunningCollector, built, sim_agent_settings};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Request};

struct Fixture {
    collector: RunningCollector,
    store: Arc<dyn Store>,
    _dir: tempfile::TempDir,
}

async fn collector_requiring_tokens() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("auth.db").display());
    let store = headroom_store::connect(&url).await.unwrap();
    let collector = Collector::builder(store.clone())
        .require_agent_tokens(true)
        .build()
        .await
        .unwrap();
    Fixture {
        collector: RunningCollector::start_collector(collector).await,
        store,
        _dir: dir,
    }
}

/// Enrols a token for `node` (`None`: any node) and returns it.
async fn enrol(store: &dyn Store, node: Option<&str>) -> (i64, String) {
    fixtures::enrol_token(store, TokenRole::Agent, node, None).await
}

async fn client(c: &RunningCollector) -> IngestClient<Channel> {
    IngestClient::connect(c.grpc_url()).await.unwrap()
}

fn with_token<T>(message: T, token: &str) -> Request<T> {
    let mut request = Request::new(message);
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    request
}

async fn register(
    client: &mut IngestClient<Channel>,
    req: pb::RegisterRequest,
    token: Option<&str>,
) -> Result<u64, tonic::Status> {
    let request = match token {
        Some(token) => with_token(req, token),
        None => Request::new(req),
    };
    client
        .register(request)
        .await
        .map(|r| r.into_inner().committed_seq)
}

/// An open stream: batches go in through `send`, answers come out of `acks`.
struct OpenStream {
    send: mpsc::Sender<pb::Batch>,
    acks: tonic::Streaming<pb::Ack>,
}

async fn open_stream(client: &mut IngestClient<Channel>, token: &str) -> OpenStream {
    let (send, rx) = mpsc::channel(4);
    let acks = client
        .stream(with_token(ReceiverStream::new(rx), token))
        .await
        .unwrap()
        .into_inner();
    OpenStream { send, acks }
}

impl OpenStream {
    async fn exchange(&mut self, batch: pb::Batch) -> Result<u64, tonic::Status> {
        self.send.send(batch).await.unwrap();
        match self.acks.message().await {
            // Taken in; its samples may still wait in open chunks.
            Ok(Some(ack)) => Ok(ack.accepted_seq),
            Ok(None) => Err(tonic::Status::aborted("stream ended")),
            Err(status) => Err(status),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_an_enrolled_token_for_the_node_gets_in_until_it_is_revoked() {
    let f = collector_requiring_tokens().await;
    let (id, token) = enrol(f.store.as_ref(), Some(NODE)).await;
    let mut c = client(&f.collector).await;

    let refused = register(&mut c, fixtures::register(NODE, BOOT), None)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    assert!(refused.message().contains("no agent token"), "{refused:?}");

    let refused = register(&mut c, fixtures::register(NODE, BOOT), Some("hra_guess"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated);
    assert!(
        refused.message().contains("unknown or revoked"),
        "{refused:?}"
    );

    let refused = register(&mut c, fixtures::register_other_node(), Some(&token))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied);
    assert!(refused.message().contains(NODE), "{refused:?}");

    assert_eq!(
        register(&mut c, fixtures::register(NODE, BOOT), Some(&token))
            .await
            .unwrap(),
        0
    );
    let without = c
        .stream(Request::new(ReceiverStream::new(mpsc::channel(1).1)))
        .await
        .unwrap_err();
    assert_eq!(without.code(), Code::Unauthenticated);

    let mut stream = open_stream(&mut c, &token).await;
    let t0 = now_ms();
    assert_eq!(stream.exchange(fixtures::batch(1, t0)).await.unwrap(), 1);
    // Speaking for another node on an authenticated stream is refused too.
    let mut other = open_stream(&mut c, &token).await;
    let refused = other
        .exchange(fixtures::other_node_batch(1, t0))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied);

    // Revocation reaches the open stream within the refresh interval.
    assert!(f.store.revoke_token(id, now_ms()).await.unwrap());
    let deadline = std::time::Instant::now() + REFRESH + Duration::from_secs(5);
    let mut seq = 2;
    let cut = loop {
        match stream.exchange(fixtures::batch(seq, now_ms())).await {
            Ok(_) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the revoked token still streams"
                );
                seq += 1;
                tokio::time::sleep(Duration::from_millis(400)).await;
            }
            Err(status) => break status,
        }
    };
    assert_eq!(cut.code(), Code::Unauthenticated, "{cut:?}");
    let refused = register(&mut c, fixtures::register(NODE, BOOT), Some(&token))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated);

    let metrics = reqwest::get(f.collector.api("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let failures: u64 = metrics
        .lines()
        .find(|l| l.starts_with("headroom_collector_agent_auth_failures_total"))
        .and_then(|l| l.rsplit(' ').next())
        .unwrap()
        .parse()
        .unwrap();
    assert!(failures >= 5, "{failures}");
    f.collector.stop().await;
}

#[tokio::test]
async fn a_peer_that_keeps_failing_is_locked_out_but_a_valid_token_still_gets_in() {
    let f = collector_requiring_tokens().await;
    let (_, token) = enrol(f.store.as_ref(), None).await;
    let mut c = client(&f.collector).await;
    for _ in 0..MAX_FAILURES {
        let refused = register(&mut c, fixtures::register(NODE, BOOT), Some("hra_wrong"))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), Code::Unauthenticated);
    }
    let refused = register(
        &mut c,
        fixtures::register(NODE, BOOT),
        Some("hra_another_guess"),
    )
    .await
    .unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated);
    assert!(
        refused.message().contains("too many failed attempts"),
        "{refused:?}"
    );
    // Guessing from a shared address (a NAT, a node whose users send junk)
    // must not lock out the agent that holds a real token.
    assert_eq!(
        register(&mut c, fixtures::register(NODE, BOOT), Some(&token))
            .await
            .unwrap(),
        0
    );
    f.collector.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_presents_its_token() {
    let f = collector_requiring_tokens().await;
    let (_, token) = enrol(f.store.as_ref(), Some("gpu-node-01")).await;
    let agent = headroom_agent::start(
        AgentSettings {
            token: Some(AgentToken::new(&token).unwrap()),
            ..sim_agent_settings(f.collector.grpc_url(), "gpu-node-01")
        },
        Box::new(SimSource::new(&Scenario::demo(), "gpu-node-01").unwrap()),
    )
    .unwrap();
    f.collector.wait_for_samples("the agent's samples").await;
    agent.stop().await;
    f.collector.stop().await;
}

fn token_cli(db: &str, args: &[&str]) -> std::process::Output {
    Command::new(built("headroom-collector"))
        .arg("token")
        .args(args)
        .env("HEADROOM_DATABASE_URL", db)
        .env_remove("HEADROOM_CONFIG")
        .output()
        .unwrap()
}

#[test]
fn the_token_command_prints_a_token_once_and_stores_only_its_hash() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("cli.db").display());
    let created = token_cli(&db, &["create", "--node", "gpu-node-07"]);
    assert!(created.status.success(), "{created:?}");
    let token = String::from_utf8(created.stdout).unwrap().trim().to_owned();
    assert!(token.starts_with("hra_") && token.len() == 68, "{token}");

    let listed = token_cli(&db, &["list"]);
    let listing = String::from_utf8(listed.stdout).unwrap();
    assert!(
        listing.contains("gpu-node-07") && listing.contains("active"),
        "{listing}"
    );
    assert!(
        listing.contains(&token[..12]),
        "the hint identifies it: {listing}"
    );
    assert!(
        !listing.contains(&token),
        "never the token itself: {listing}"
    );
    let on_disk = std::fs::read(dir.path().join("cli.db")).unwrap();
    assert!(
        !on_disk.windows(token.len()).any(|w| w == token.as_bytes()),
        "the database holds no token"
    );

    let revoked = token_cli(&db, &["revoke", "1"]);
    assert!(revoked.status.success(), "{revoked:?}");
    let again = token_cli(&db, &["revoke", "1"]);
    assert!(!again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("no active token with id 1"),
        "{again:?}"
    );
    let missing = token_cli(&db, &["create"]);
    assert!(
        !missing.status.success(),
        "a node, --any-node or --role is required"
    );

    let admin = token_cli(&db, &["create", "--role", "admin", "--name", "alice"]);
    assert!(admin.status.success(), "{admin:?}");
    let admin = String::from_utf8(admin.stdout).unwrap().trim().to_owned();
    assert!(admin.starts_with("hrd_") && admin.len() == 68, "{admin}");
    let listing = String::from_utf8(token_cli(&db, &["list"]).stdout).unwrap();
    let alice = listing
        .lines()
        .find(|l| l.contains("alice"))
        .unwrap_or_else(|| panic!("{listing}"));
    assert!(
        alice.contains("admin") && alice.contains(&admin[..12]),
        "{alice}"
    );
    for refused in [
        &["create", "--role", "viewer"][..],
        &["create", "--node", "n1", "--role", "admin", "--name", "bob"],
        &["create", "--role", "root", "--name", "bob"],
    ] {
        let out = token_cli(&db, refused);
        assert!(!out.status.success(), "{refused:?} must be refused");
    }
}
