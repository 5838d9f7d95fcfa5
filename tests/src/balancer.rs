//! A layer-4 load balancer for tests: each connection goes to the first
//! backend that accepts one, as a balancer with health checks sends agents
//! to a collector that is up. When that collector dies, its connections
//! close and the next ones go to another.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

#[derive(Debug)]
pub struct Balancer {
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Balancer {
    /// Listens on a free loopback port in front of `backends`, in order of
    /// preference.
    pub async fn start(backends: Vec<SocketAddr>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let backends = backends.clone();
                tokio::spawn(async move {
                    for backend in backends {
                        if let Ok(mut outbound) = TcpStream::connect(backend).await {
                            let _ =
                                tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                            return;
                        }
                    }
                });
            }
        });
        Self { addr, task }
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
