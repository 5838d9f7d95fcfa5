//! The HTTP server loop: accepts connections and serves the router on each
//! with hyper's HTTP/1, under the limits of `[http]` that `axum::serve`
//! cannot set:
//!
//! - at most `max_connections` at once; one more is answered at once with a
//!   `503` (JSON, `Retry-After: 1`, `Connection: close`) and closed, its
//!   request unread, so a flood of idle sockets cannot grow memory and a
//!   client over the limit learns it at once instead of hanging;
//! - a request's headers must arrive within `header_read_timeout_s` of the
//!   connection opening or of the previous response ending (slowloris, and
//!   idle keep-alive connections);
//! - a connection with nothing read or written for `idle_timeout_s` is
//!   closed (a stalled upload, a client that stopped reading).
//!
//! Each request carries `ConnectInfo<SocketAddr>`, as with
//! `into_make_service_with_connect_info`: the peer address feeds the
//! sign-in lockout and the proxy check. On shutdown the listener closes,
//! idle connections close, and requests in flight finish.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::time::Instant;

use super::settings::HttpServerConfig;
use crate::metrics::{CollectorMetrics, HttpRefusal};

/// Serves `router` on `listener` until `shutdown` resolves, then stops
/// accepting, closes idle connections and waits for requests in flight.
pub async fn serve_http(
    listener: TcpListener,
    router: Router,
    config: &HttpServerConfig,
    metrics: Arc<CollectorMetrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let max_connections = config.max_connections.max(1);
    let slots = Arc::new(Semaphore::new(max_connections as usize));
    let idle = Duration::from_secs(u64::from(config.idle_timeout_s.max(1)));
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(u64::from(
            config.header_read_timeout_s.max(1),
        )))
        .keep_alive(true);
    let (stop, stopping) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(error) => {
                    accept_failed(error).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            metrics.http_refused(HttpRefusal::Connections);
            tracing::debug!(%peer, max_connections, "refused an HTTP connection: too many open");
            refuse(&stream, max_connections);
            continue;
        };
        metrics.http_connection(true);
        let connection = Connection {
            builder: builder.clone(),
            router: router.clone(),
            peer,
            idle,
            stopping: stopping.clone(),
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            connection.run(stream).await;
            metrics.http_connection(false);
            drop(slot);
        });
    }
    drop(listener);
    let _ = stop.send(true);
    // Every connection holds a slot until it ends: all of them back means
    // every request in flight has finished.
    let _ = slots.acquire_many(max_connections).await;
    Ok(())
}

/// An error accepting is the client's (it hung up before we got to it) or
/// the machine's (out of file descriptors): neither ends the server, and
/// the second is waited out rather than spun on.
async fn accept_failed(error: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        error.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return;
    }
    tracing::error!(%error, "accepting an HTTP connection failed; retrying in 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

/// Answers a connection over the limit without reading from it. A fresh
/// socket's send buffer is empty, so the write does not block; if it does
/// not go through, the client sees the connection closed, which says the
/// same.
fn refuse(stream: &TcpStream, max_connections: u32) {
    let body = format!(
        "{{\"error\":\"too many connections: this collector serves {max_connections} at once ([http] max_connections); retry shortly\"}}"
    );
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.try_write(response.as_bytes());
}

struct Connection {
    builder: hyper::server::conn::http1::Builder,
    router: Router,
    peer: SocketAddr,
    idle: Duration,
    stopping: watch::Receiver<bool>,
}

impl Connection {
    async fn run(self, stream: TcpStream) {
        let Self {
            builder,
            router,
            peer,
            idle,
            mut stopping,
        } = self;
        let started = Instant::now();
        let io = Watched {
            inner: stream,
            started,
            last_ms: Arc::new(AtomicU64::new(0)),
        };
        let last_ms = io.last_ms.clone();
        let service = hyper::service::service_fn(move |mut request: hyper::Request<Incoming>| {
            request.extensions_mut().insert(ConnectInfo(peer));
            let mut router = router.clone();
            tower_service::Service::call(&mut router, request)
        });
        let connection = builder.serve_connection(TokioIo::new(io), service);
        tokio::pin!(connection);
        let mut closing = false;
        loop {
            let last = started + Duration::from_millis(last_ms.load(Ordering::Relaxed));
            tokio::select! {
                result = connection.as_mut() => {
                    if let Err(error) = result {
                        tracing::debug!(%peer, %error, "HTTP connection ended");
                    }
                    return;
                }
                _ = stopping.wait_for(|stop| *stop), if !closing => {
                    closing = true;
                    connection.as_mut().graceful_shutdown();
                }
                () = tokio::time::sleep_until(last + idle) => {
                    let quiet = Instant::now().saturating_duration_since(
                        started + Duration::from_millis(last_ms.load(Ordering::Relaxed)),
                    );
                    if quiet >= idle {
                        tracing::debug!(%peer, idle_s = quiet.as_secs(),
                            "closing an HTTP connection with nothing read or written");
                        return;
                    }
                }
            }
        }
    }
}

/// A TCP stream that notes when a byte last went either way.
struct Watched {
    inner: TcpStream,
    started: Instant,
    /// Milliseconds after `started`.
    last_ms: Arc<AtomicU64>,
}

impl Watched {
    fn touch(&self) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.touch();
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
