//! A real Postgres for tests. `DATABASE_URL` names a server when set;
//! otherwise a throwaway cluster is created with `initdb` and `pg_ctl` in a
//! temporary folder, once per test process, and stopped when the process
//! ends. Every test gets a database of its own.
//!
//! Without a server and without `initdb`, tests skip with a loud message,
//! except under `CI=true`, where that is a failure: CI never skips Postgres.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use anyhow::{Context, bail};
use rand::Rng;
use sqlx::Connection;
use sqlx::postgres::PgConnection;

/// A database created for one test.
#[derive(Debug)]
pub struct TestDatabase {
    pub url: String,
    admin_url: String,
    name: String,
}

impl TestDatabase {
    /// Drops the database; call at the end of a test that passed.
    pub async fn drop_database(self) {
        if let Ok(mut conn) = PgConnection::connect(&self.admin_url).await {
            let _ = sqlx::query(&format!(
                "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
                self.name
            ))
            .execute(&mut conn)
            .await;
        }
    }
}

/// A fresh, empty database, or `None` when Postgres cannot be had outside CI.
pub async fn fresh_database() -> Option<TestDatabase> {
    let admin_url = match admin_url() {
        Ok(url) => url,
        Err(error) => {
            crate::skip_or_fail_under_ci("the Postgres test", format!("{error:#}"));
            return None;
        }
    };
    let name = format!("headroom_test_{:016x}", rand::rng().random::<u64>());
    let mut conn = PgConnection::connect(&admin_url)
        .await
        .unwrap_or_else(|e| panic!("connecting to test Postgres at {admin_url}: {e}"));
    sqlx::query(&format!("CREATE DATABASE \"{name}\""))
        .execute(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("creating database {name}: {e}"));
    Some(TestDatabase {
        url: replace_database(&admin_url, &name),
        admin_url,
        name,
    })
}

fn replace_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let host_part = base.find("://").map_or(0, |i| i + 3);
    let base = match base[host_part..].find('/') {
        Some(slash) => &base[..host_part + slash],
        None => base,
    };
    match query {
        Some(q) => format!("{base}/{name}?{q}"),
        None => format!("{base}/{name}"),
    }
}

fn admin_url() -> anyhow::Result<String> {
    if let Ok(url) = std::env::var("DATABASE_URL")
        && !url.is_empty()
    {
        return Ok(url);
    }
    static CLUSTER: OnceLock<Result<String, String>> = OnceLock::new();
    CLUSTER
        .get_or_init(|| start_throwaway_cluster().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(|e| anyhow::anyhow!("DATABASE_URL is not set and no throwaway cluster: {e}"))
}

fn find_bin(name: &str) -> Option<PathBuf> {
    let from_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    });
    from_path.or_else(|| {
        let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path().join("bin").join(name)))
            .filter(|p| p.is_file())
            .collect();
        versions.sort();
        versions.pop()
    })
}

/// A folder of its own for a cluster, kept until the cluster removes it,
/// and owned by `postgres` when the tests run as root.
fn cluster_folder(prefix: &str) -> anyhow::Result<PathBuf> {
    let dir = tempfile::Builder::new().prefix(prefix).tempdir()?.keep();
    if is_root() {
        let mut chown = Command::new("chown");
        chown.arg("postgres:").arg(&dir);
        run(chown, "chown of the cluster folder")?;
    }
    Ok(dir)
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Whether the tests run as root (Postgres refuses to; chroot needs it).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

/// Postgres refuses to run as root; as root, run its tools as `postgres`.
fn pg_command(bin: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin);
        c
    } else {
        Command::new(bin)
    }
}

fn run(mut command: Command, what: &str) -> anyhow::Result<()> {
    let out = command
        .output()
        .with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// A Postgres cluster of its own in a temporary folder, for tests that stop
/// and start the server under a running collector.
#[derive(Debug)]
pub struct Cluster {
    dir: PathBuf,
    data: PathBuf,
    pg_ctl: PathBuf,
    port: u16,
    durable: bool,
}

impl Cluster {
    /// Creates and starts a cluster on a free port (trust auth), fast and
    /// not crash-safe: no fsync, commits acknowledged before they are durable.
    pub fn create() -> anyhow::Result<Self> {
        Self::create_with(false)
    }

    /// As [`Cluster::create`], but a commit survives a crash of the server
    /// (`stop_immediately`), as in production: for tests that crash it.
    pub fn create_durable() -> anyhow::Result<Self> {
        Self::create_with(true)
    }

    fn create_with(durable: bool) -> anyhow::Result<Self> {
        let initdb = find_bin("initdb").context("initdb not found (install postgresql)")?;
        let pg_ctl = find_bin("pg_ctl").context("pg_ctl not found")?;
        let dir = cluster_folder("headroom-pg-")?;
        let data = dir.join("data");
        let mut init = pg_command(&initdb);
        init.arg("-D").arg(&data).args([
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
            "-E",
            "UTF8",
        ]);
        run(init, "initdb")?;
        let port = free_port()?;
        let cluster = Self {
            dir,
            data,
            pg_ctl,
            port,
            durable,
        };
        cluster.start()?;
        Ok(cluster)
    }

    /// A streaming standby of `primary` (`pg_basebackup -R`), started on a
    /// port of its own and crash-safe like a production server.
    pub fn standby_of(primary: &Cluster) -> anyhow::Result<Self> {
        let basebackup = find_bin("pg_basebackup").context("pg_basebackup not found")?;
        let dir = cluster_folder("headroom-pg-standby-")?;
        let data = dir.join("data");
        let mut backup = pg_command(&basebackup);
        backup
            .args(["-h", "127.0.0.1", "-p", &primary.port.to_string()])
            .args(["-U", "postgres", "-D"])
            .arg(&data)
            .args(["-R", "-X", "stream", "--no-sync"]);
        run(backup, "pg_basebackup")?;
        let port = free_port()?;
        let standby = Self {
            dir,
            data,
            pg_ctl: primary.pg_ctl.clone(),
            port,
            durable: true,
        };
        standby.start()?;
        Ok(standby)
    }

    /// Makes a standby the primary (`pg_ctl promote`), waiting until it is.
    pub fn promote(&self) -> anyhow::Result<()> {
        let mut promote = pg_command(&self.pg_ctl);
        promote.arg("-D").arg(&self.data).args(["-w", "promote"]);
        run(promote, "pg_ctl promote")
    }

    /// `127.0.0.1:PORT`, as a host of a multi-host URL.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn admin_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Starts the server and waits until it accepts connections.
    pub fn start(&self) -> anyhow::Result<()> {
        let mut start = pg_command(&self.pg_ctl);
        start
            .arg("-D")
            .arg(&self.data)
            .arg("-l")
            .arg(self.dir.join("postgres.log"))
            .arg("-w")
            .arg("-o")
            .arg(format!(
                "-p {} -k {} -c listen_addresses=127.0.0.1 -c max_connections=200 {}",
                self.port,
                self.dir.display(),
                if self.durable {
                    ""
                } else {
                    "-c fsync=off -c synchronous_commit=off"
                }
            ))
            .arg("start");
        run(start, "pg_ctl start")
    }

    /// Stops the server as a crash would: no checkpoint, clients cut off.
    pub fn stop_immediately(&self) -> anyhow::Result<()> {
        let mut stop = pg_command(&self.pg_ctl);
        stop.arg("-D")
            .arg(&self.data)
            .args(["-m", "immediate", "-w", "stop"]);
        run(stop, "pg_ctl stop")
    }

    /// Leaves the cluster running until this test process exits, then stops
    /// it and removes its folder.
    fn reap_at_exit(self) -> anyhow::Result<String> {
        let url = self.admin_url();
        let stop = format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 1; done; {runas}{pg_ctl} -D {data} -m immediate stop >/dev/null 2>&1; rm -rf {dir}",
            pid = std::process::id(),
            runas = if is_root() {
                "runuser -u postgres -- "
            } else {
                ""
            },
            pg_ctl = self.pg_ctl.display(),
            data = self.data.display(),
            dir = self.dir.display(),
        );
        std::mem::forget(self);
        Command::new("setsid")
            .args(["sh", "-c", &stop])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("starting the cluster's reaper")?;
        Ok(url)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.stop_immediately();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn start_throwaway_cluster() -> anyhow::Result<String> {
    Cluster::create()?.reap_at_exit()
}

/// `YYYYMMDD` of the UTC day holding `ts_ms`, as partition names end
/// (days-from-civil, inverted).
pub fn day_suffix(ts_ms: i64) -> String {
    let z = ts_ms.div_euclid(86_400_000) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}{month:02}{day:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn day_suffix_names_the_utc_day() {
        assert_eq!(day_suffix(0), "19700101");
        assert_eq!(day_suffix(1_764_460_800_000), "20251130");
        assert_eq!(day_suffix(1_709_164_800_000 + 86_400_000 - 1), "20240229");
    }

    #[test]
    fn database_name_is_swapped_keeping_options() {
        assert_eq!(
            replace_database("postgres://u@h:5/test?sslmode=disable", "x"),
            "postgres://u@h:5/x?sslmode=disable"
        );
        assert_eq!(
            replace_database("postgres://u@h:5", "x"),
            "postgres://u@h:5/x"
        );
    }
}
