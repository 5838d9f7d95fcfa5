//! Who may read the dashboard and the API and who may act, over real HTTP
//! on loopback: dashboard tokens (bearer and the sign-in cookie), a trusted
//! reverse proxy's user header, viewer against admin, revocation, the
//! sign-in lockout, and cross-site changes refused in every mode.

use std::sync::Arc;
use std::time::{Duration, Instant};

use headroom_collector::Collector;
use headroom_collector::auth::cache::REFRESH;
use headroom_collector::auth::lockout::MAX_FAILURES;
use headroom_collector::http::auth::{HttpAuthConfig, HttpAuthMode};
use headroom_store::Store;
use headroom_store::tokens::TokenRole;
use headroom_tests::fixtures::{enrol_token, now_ms};
use headroom_tests::harness::{RunningCollector, built};
use reqwest::StatusCode;
use serde_json::{Value, json};

struct Fixture {
    collector: RunningCollector,
    store: Arc<dyn Store>,
    http: reqwest::Client,
    _dir: tempfile::TempDir,
}

async fn collector_with(auth: HttpAuthConfig) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("auth.db").display());
    let store = headroom_store::connect(&url).await.unwrap();
    let collector = Collector::builder(store.clone())
        .http_auth(auth)
        .build()
        .await
        .unwrap();
    Fixture {
        collector: RunningCollector::start_collector(collector).await,
        store,
        http: reqwest::Client::new(),
        _dir: dir,
    }
}

fn tokens_mode() -> HttpAuthConfig {
    HttpAuthConfig {
        mode: HttpAuthMode::Tokens,
        ..HttpAuthConfig::default()
    }
}

fn silence(created_by: &str) -> Value {
    json!({
        "matchers": { "node": "gpu-node-01" },
        "comment": "maintenance",
        "created_by": created_by,
        "ends_at_ms": now_ms() + 3_600_000,
    })
}

impl Fixture {
    async fn get(&self, path: &str, auth: Auth<'_>) -> reqwest::Response {
        auth.apply(self.http.get(self.collector.api(path)))
            .send()
            .await
            .unwrap()
    }

    async fn post(&self, path: &str, auth: Auth<'_>, body: &Value) -> reqwest::Response {
        auth.apply(self.http.post(self.collector.api(path)).json(body))
            .send()
            .await
            .unwrap()
    }
}

#[derive(Clone, Copy)]
enum Auth<'a> {
    Nobody,
    Bearer(&'a str),
    Cookie(&'a str),
    ProxyUser(&'a str),
}

impl Auth<'_> {
    fn apply(self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match self {
            Self::Nobody => request,
            Self::Bearer(token) => request.bearer_auth(token),
            Self::Cookie(token) => request.header("cookie", format!("headroom_token={token}")),
            Self::ProxyUser(user) => request.header("x-forwarded-user", user),
        }
    }
}

#[tokio::test]
async fn tokens_let_viewers_read_and_only_admins_act_in_their_own_name() {
    let f = collector_with(tokens_mode()).await;
    let (_, viewer) = enrol_token(f.store.as_ref(), TokenRole::Viewer, None, Some("grafana")).await;
    let (_, admin) = enrol_token(f.store.as_ref(), TokenRole::Admin, None, Some("alice")).await;
    let (_, agent) = enrol_token(f.store.as_ref(), TokenRole::Agent, None, None).await;

    // The page and its scripts load for anyone (they hold no data), so the
    // sign-in form can show; the health check answers load balancers.
    for open in ["/", "/assets/app.js", "/healthz"] {
        assert_eq!(
            f.get(open, Auth::Nobody).await.status(),
            StatusCode::OK,
            "{open}"
        );
    }
    for closed in [
        "/api/v1/gpus",
        "/api/v1/alerts",
        "/api/v1/stream",
        "/metrics",
    ] {
        let refused = f.get(closed, Auth::Nobody).await;
        assert_eq!(refused.status(), StatusCode::UNAUTHORIZED, "{closed}");
        let body: Value = refused.json().await.unwrap();
        assert!(
            body["error"].as_str().unwrap().contains("not signed in"),
            "{body}"
        );
    }
    let session: Value = f
        .get("/api/v1/session", Auth::Nobody)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        session["auth"], "tokens",
        "the page learns how to sign in: {session}"
    );

    assert_eq!(
        f.get("/api/v1/gpus", Auth::Bearer(&viewer)).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        f.get("/metrics", Auth::Bearer(&viewer)).await.status(),
        StatusCode::OK
    );
    let forbidden = f
        .post(
            "/api/v1/silences",
            Auth::Bearer(&viewer),
            &silence("grafana"),
        )
        .await;
    assert_eq!(forbidden.status(), StatusCode::FORBIDDEN);
    let body: Value = forbidden.json().await.unwrap();
    assert!(
        body["error"].as_str().unwrap().contains("need an admin"),
        "{body}"
    );

    let agent_refused = f.get("/api/v1/gpus", Auth::Bearer(&agent)).await;
    assert_eq!(agent_refused.status(), StatusCode::UNAUTHORIZED);
    let body: Value = agent_refused.json().await.unwrap();
    assert!(
        body["error"].as_str().unwrap().contains("agent token"),
        "{body}"
    );
    let unknown = format!("hrd_{}", "0".repeat(64));
    assert_eq!(
        f.get("/api/v1/gpus", Auth::Bearer(&unknown)).await.status(),
        StatusCode::UNAUTHORIZED
    );

    // An admin acts, and the record names the token's holder, not the claim.
    let created = f
        .post(
            "/api/v1/silences",
            Auth::Bearer(&admin),
            &silence("mallory"),
        )
        .await;
    assert_eq!(created.status(), StatusCode::CREATED);
    let silences: Value = f
        .get("/api/v1/silences", Auth::Bearer(&viewer))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(silences[0]["created_by"], "alice", "{silences}");
    f.collector.stop().await;
}

#[tokio::test]
async fn signing_in_sets_a_script_proof_cookie_that_revocation_and_sign_out_end() {
    let f = collector_with(tokens_mode()).await;
    let (admin_id, admin) =
        enrol_token(f.store.as_ref(), TokenRole::Admin, None, Some("alice")).await;

    let signed_in = f
        .post("/api/v1/session", Auth::Nobody, &json!({ "token": admin }))
        .await;
    assert_eq!(signed_in.status(), StatusCode::OK);
    let cookie = signed_in.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .to_owned();
    for part in ["headroom_token=", "HttpOnly", "SameSite=Strict", "Path=/"] {
        assert!(cookie.contains(part), "{cookie}");
    }
    let who: Value = signed_in.json().await.unwrap();
    assert_eq!(
        (who["user"].as_str(), who["role"].as_str()),
        (Some("alice"), Some("admin"))
    );
    assert!(
        !who.to_string().contains(&admin),
        "the token is never echoed back: {who}"
    );

    let session: Value = f
        .get("/api/v1/session", Auth::Cookie(&admin))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(session["may_act"], true, "{session}");
    assert_eq!(
        f.get("/api/v1/gpus", Auth::Cookie(&admin)).await.status(),
        StatusCode::OK
    );

    for wrong in ["hunter2", &format!("hrd_{}", "f".repeat(64))] {
        let refused = f
            .post("/api/v1/session", Auth::Nobody, &json!({ "token": wrong }))
            .await;
        assert_eq!(refused.status(), StatusCode::UNAUTHORIZED, "{wrong}");
        assert!(refused.headers().get("set-cookie").is_none());
    }

    let signed_out = f
        .http
        .delete(f.collector.api("/api/v1/session"))
        .send()
        .await
        .unwrap();
    assert!(
        signed_out.headers()["set-cookie"]
            .to_str()
            .unwrap()
            .contains("Max-Age=0")
    );

    // Revoked: the browser that still holds the cookie is refused within
    // the token list's refresh.
    assert!(f.store.revoke_token(admin_id, now_ms()).await.unwrap());
    let deadline = Instant::now() + REFRESH + Duration::from_secs(5);
    loop {
        let status = f.get("/api/v1/gpus", Auth::Cookie(&admin)).await.status();
        if status == StatusCode::UNAUTHORIZED {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "revoked cookie still answered {status}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    f.collector.stop().await;
}

#[tokio::test]
async fn guessing_locks_an_address_out_but_a_valid_token_still_gets_in() {
    let f = collector_with(tokens_mode()).await;
    let (viewer_id, viewer) =
        enrol_token(f.store.as_ref(), TokenRole::Viewer, None, Some("ops")).await;
    // Known before the lockout, as a signed-in user's token would be.
    assert_eq!(
        f.get("/api/v1/gpus", Auth::Bearer(&viewer)).await.status(),
        StatusCode::OK
    );
    for i in 0..MAX_FAILURES {
        let guess = format!("hrd_{i:064x}");
        let status = f
            .post("/api/v1/session", Auth::Nobody, &json!({ "token": guess }))
            .await
            .status();
        assert_eq!(status, StatusCode::UNAUTHORIZED);
    }
    let locked = f
        .post(
            "/api/v1/session",
            Auth::Nobody,
            &json!({ "token": format!("hrd_{}", "a".repeat(64)) }),
        )
        .await;
    assert_eq!(locked.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry_after: u64 = locked.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    assert_eq!(
        f.get("/api/v1/gpus", Auth::Bearer(&viewer)).await.status(),
        StatusCode::OK
    );

    let metrics = f
        .get("/metrics", Auth::Bearer(&viewer))
        .await
        .text()
        .await
        .unwrap();
    let refused: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("headroom_collector_http_auth_failures_total "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(refused > u64::from(MAX_FAILURES), "{refused}");

    // Locked out or not, a revoked token stops working.
    assert!(f.store.revoke_token(viewer_id, now_ms()).await.unwrap());
    let deadline = Instant::now() + REFRESH + Duration::from_secs(5);
    while f.get("/api/v1/gpus", Auth::Bearer(&viewer)).await.status() == StatusCode::OK {
        assert!(
            Instant::now() < deadline,
            "a revoked token still works from a locked-out address"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    f.collector.stop().await;
}

#[tokio::test]
async fn the_live_stream_ends_when_its_token_is_revoked() {
    let f = collector_with(tokens_mode()).await;
    let (id, viewer) = enrol_token(f.store.as_ref(), TokenRole::Viewer, None, Some("wall")).await;
    let mut stream = f.get("/api/v1/stream", Auth::Bearer(&viewer)).await;
    assert_eq!(stream.status(), StatusCode::OK);
    let first = stream.chunk().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("snapshot"));
    assert!(f.store.revoke_token(id, now_ms()).await.unwrap());
    let ended = tokio::time::timeout(REFRESH + Duration::from_secs(5), async {
        while let Some(_event) = stream.chunk().await.transpose() {}
    })
    .await;
    assert!(ended.is_ok(), "the stream outlived its token's revocation");
    f.collector.stop().await;
}

#[tokio::test]
async fn a_trusted_proxy_names_the_user_and_only_listed_admins_act() {
    let f = collector_with(HttpAuthConfig {
        mode: HttpAuthMode::Proxy,
        admin_users: vec!["alice".into()],
        ..HttpAuthConfig::default()
    })
    .await;
    assert_eq!(
        f.get("/api/v1/gpus", Auth::Nobody).await.status(),
        StatusCode::UNAUTHORIZED
    );
    let session: Value = f
        .get("/api/v1/session", Auth::ProxyUser("bob"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        (session["user"].as_str(), session["role"].as_str()),
        (Some("bob"), Some("viewer"))
    );
    let bob = f
        .post("/api/v1/silences", Auth::ProxyUser("bob"), &silence("bob"))
        .await;
    assert_eq!(bob.status(), StatusCode::FORBIDDEN);
    let alice = f
        .post(
            "/api/v1/silences",
            Auth::ProxyUser("alice"),
            &silence("someone else"),
        )
        .await;
    assert_eq!(alice.status(), StatusCode::CREATED);
    let silences: Value = f
        .get("/api/v1/silences", Auth::ProxyUser("bob"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(silences[0]["created_by"], "alice");

    // A proxy that passes on its identity provider's own bearer token still
    // names the user.
    let passed_on = f
        .http
        .get(f.collector.api("/api/v1/session"))
        .header("x-forwarded-user", "alice")
        .bearer_auth("eyJhbGciOi.idp-token")
        .send()
        .await
        .unwrap();
    assert_eq!(passed_on.status(), StatusCode::OK);
    assert_eq!(passed_on.json::<Value>().await.unwrap()["user"], "alice");

    // A client's own header that the proxy appended to instead of
    // replacing is believed from neither.
    let doubled = f
        .http
        .get(f.collector.api("/api/v1/gpus"))
        .header("x-forwarded-user", "alice")
        .header("x-forwarded-user", "bob")
        .send()
        .await
        .unwrap();
    assert_eq!(doubled.status(), StatusCode::UNAUTHORIZED);

    // Tokens still serve what cannot sign in through the proxy (Prometheus).
    let (_, scraper) = enrol_token(
        f.store.as_ref(),
        TokenRole::Viewer,
        None,
        Some("prometheus"),
    )
    .await;
    assert_eq!(
        f.get("/metrics", Auth::Bearer(&scraper)).await.status(),
        StatusCode::OK
    );
    // There is no token sign-in behind a proxy.
    let sign_in = f
        .post(
            "/api/v1/session",
            Auth::Nobody,
            &json!({ "token": scraper }),
        )
        .await;
    assert_eq!(sign_in.status(), StatusCode::CONFLICT);
    f.collector.stop().await;
}

#[tokio::test]
async fn the_user_header_from_an_untrusted_address_is_refused() {
    let f = collector_with(HttpAuthConfig {
        mode: HttpAuthMode::Proxy,
        admin_users: vec!["alice".into()],
        trusted_proxies: vec!["10.0.0.0/8".parse().unwrap()],
        ..HttpAuthConfig::default()
    })
    .await;
    let forged = f.get("/api/v1/gpus", Auth::ProxyUser("alice")).await;
    assert_eq!(forged.status(), StatusCode::UNAUTHORIZED);
    let body: Value = forged.json().await.unwrap();
    assert!(
        body["error"].as_str().unwrap().contains("trusted_proxies"),
        "{body}"
    );
    f.collector.stop().await;
}

#[tokio::test]
async fn cross_site_changes_are_refused_even_without_sign_in() {
    let f = collector_with(HttpAuthConfig::default()).await;
    let post = |origin: Option<&str>, fetch_site: Option<&str>| {
        let mut request = f
            .http
            .post(f.collector.api("/api/v1/silences"))
            .json(&silence("ops"));
        if let Some(origin) = origin {
            request = request.header("origin", origin);
        }
        if let Some(site) = fetch_site {
            request = request.header("sec-fetch-site", site);
        }
        request.send()
    };
    let evil = post(Some("https://evil.example"), None).await.unwrap();
    assert_eq!(evil.status(), StatusCode::FORBIDDEN);
    let body: Value = evil.json().await.unwrap();
    assert!(
        body["error"].as_str().unwrap().contains("cross-origin"),
        "{body}"
    );
    assert_eq!(
        post(None, Some("cross-site")).await.unwrap().status(),
        StatusCode::FORBIDDEN
    );
    let own_origin = format!("http://{}", f.collector.http_addr);
    assert_eq!(
        post(Some(&own_origin), None).await.unwrap().status(),
        StatusCode::CREATED
    );
    assert_eq!(
        post(None, Some("same-origin")).await.unwrap().status(),
        StatusCode::CREATED
    );
    assert_eq!(
        post(None, None).await.unwrap().status(),
        StatusCode::CREATED,
        "curl"
    );
    let delete = f
        .http
        .delete(f.collector.api("/api/v1/silences/1"))
        .header("origin", "https://evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(delete.status(), StatusCode::FORBIDDEN);
    f.collector.stop().await;
}

#[tokio::test]
async fn the_status_command_presents_its_token_and_says_when_one_is_missing() {
    let f = collector_with(tokens_mode()).await;
    let (_, viewer) = enrol_token(f.store.as_ref(), TokenRole::Viewer, None, Some("cli")).await;
    let url = format!("http://{}", f.collector.http_addr);
    let status = |token: Option<&str>| {
        let mut command = tokio::process::Command::new(built("headroom-collector"));
        command
            .args(["status", "--url", &url])
            .env_remove("HEADROOM_TOKEN");
        if let Some(token) = token {
            command.env("HEADROOM_TOKEN", token);
        }
        command.output()
    };
    let refused = status(None).await.unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("HEADROOM_TOKEN"), "{stderr}");
    let shown = status(Some(&viewer)).await.unwrap();
    assert!(shown.status.success(), "{shown:?}");
    assert!(String::from_utf8_lossy(&shown.stdout).contains("Firing alerts: 0"));
    f.collector.stop().await;
}
