//! The connections the ingest writers keep between writes.
//!
//! A connection borrowed from the pool goes back through a task that pings
//! it first: a round trip, queued behind the agents' streams, during which
//! the next write finds it busy and waits for another. Under load that was
//! a few milliseconds of every write's `BEGIN`. A writer's connection here
//! goes straight back, and keeps its prepared statements.

use std::sync::{Arc, Mutex};

use sqlx::Connection;
use sqlx::postgres::PgConnection;

use super::primary::Primary;
use crate::StoreError;

/// Connections kept at most; a burst of more concurrent writes opens more
/// and closes the extra ones after.
const KEEP: usize = 8;

#[derive(Debug)]
pub(super) struct WriteConnections {
    primary: Arc<Primary>,
    idle: Mutex<Vec<PgConnection>>,
}

impl WriteConnections {
    pub(super) fn new(primary: Arc<Primary>) -> Self {
        Self {
            primary,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// An idle connection, or a new one to the host written to now.
    pub(super) async fn take(&self) -> Result<PgConnection, StoreError> {
        let idle = self.idle.lock().ok().and_then(|mut idle| idle.pop());
        match idle {
            Some(conn) => Ok(conn),
            None => Ok(PgConnection::connect_with(&self.primary.options()).await?),
        }
    }

    /// Drops the idle connections (they are to a host no longer written
    /// to), without waiting for their goodbyes.
    pub(super) fn forget_idle(&self) {
        if let Ok(mut idle) = self.idle.lock() {
            idle.clear();
        }
    }

    /// Keeps `conn`, whose last write succeeded, for the next one. A
    /// connection whose write failed is dropped instead: it may be broken.
    pub(super) fn give_back(&self, conn: PgConnection) {
        if let Ok(mut idle) = self.idle.lock()
            && idle.len() < KEEP
        {
            idle.push(conn);
        }
    }

    /// Closes the idle connections.
    pub(super) async fn close(&self) {
        let idle = self
            .idle
            .lock()
            .map(|mut idle| std::mem::take(&mut *idle))
            .unwrap_or_default();
        for conn in idle {
            let _ = conn.close().await;
        }
    }
}
