//! A real HTTP endpoint that records the webhooks it receives.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use tokio::net::TcpListener;

#[derive(Debug, Clone)]
pub struct Received {
    pub headers: HeaderMap,
    pub body: String,
    /// What the receiver answered.
    pub status: u16,
}

type Shared = (Arc<Mutex<Vec<Received>>>, Arc<AtomicU16>);

#[derive(Debug, Clone)]
pub struct Receiver {
    pub addr: SocketAddr,
    received: Arc<Mutex<Vec<Received>>>,
    answer: Arc<AtomicU16>,
}

impl Receiver {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::start_on(listener).await
    }

    pub async fn start_on(listener: TcpListener) -> Self {
        let addr = listener.local_addr().unwrap();
        let received = Arc::new(Mutex::new(Vec::new()));
        let answer = Arc::new(AtomicU16::new(200));
        let state = (received.clone(), answer.clone());
        let app =
            Router::new()
                .route(
                    "/hook",
                    post(
                        |State((received, answer)): State<Shared>,
                         headers: HeaderMap,
                         body: Bytes| async move {
                            let status = answer.load(Ordering::SeqCst);
                            received.lock().unwrap().push(Received {
                                headers,
                                body: String::from_utf8_lossy(&body).into_owned(),
                                status,
                            });
                            StatusCode::from_u16(status).unwrap_or(StatusCode::OK)
                        },
                    ),
                )
                .with_state(state);
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            addr,
            received,
            answer,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    /// Makes the receiver answer `status` from now on (e.g. 503 to refuse).
    pub fn answer_with(&self, status: u16) {
        self.answer.store(status, Ordering::SeqCst);
    }

    pub fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    /// Requests it accepted (2xx).
    pub fn accepted(&self) -> Vec<Received> {
        self.received()
            .into_iter()
            .filter(|r| (200..300).contains(&r.status))
            .collect()
    }
}
