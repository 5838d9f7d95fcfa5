//! CPU time of the processes a benchmark puts side by side, read from
//! `/proc`: a Postgres server on this machine (the postmaster, its live
//! children and the children it has reaped) and threads of this process.
//! Rates on a shared two-core machine move with whatever else runs; CPU
//! seconds per row say which side of a write path the time went to.

use headroom_agent::attribution::process::USER_HZ;

/// The parent pid and the CPU clock ticks (user and system) in a
/// `/proc/<pid>/stat` line, with the children it has waited for when
/// `with_reaped`.
fn stat_cpu_ticks(stat: &str, with_reaped: bool) -> Option<(u32, u64)> {
    // The command name may hold spaces and parentheses: fields are counted
    // from the last ')'. After it: state (3), ppid (4), …, utime (14),
    // stime (15), cutime (16), cstime (17).
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    let ppid = u32::try_from(field(4)?).ok()?;
    let mut ticks = field(14)? + field(15)?;
    if with_reaped {
        ticks += field(16)? + field(17)?;
    }
    Some((ppid, ticks))
}

/// CPU seconds of the Postgres server whose postmaster is `postmaster`:
/// its own, its live children's (backends, WAL writer, checkpointer,
/// autovacuum) and those of the children that exited. `None` when the
/// postmaster is not readable here (a server on another machine).
pub fn postgres_seconds(postmaster: u32) -> Option<f64> {
    let own = std::fs::read_to_string(format!("/proc/{postmaster}/stat")).ok()?;
    let (_, mut ticks) = stat_cpu_ticks(&own, true)?;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == postmaster {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue; // exited since the listing
        };
        if let Some((ppid, child)) = stat_cpu_ticks(&stat, false)
            && ppid == postmaster
        {
            ticks += child;
        }
    }
    Some(ticks as f64 / USER_HZ as f64)
}

/// CPU seconds of process `pid` (every thread of it, and the children it
/// waited for); `None` when it is not readable here.
pub fn process_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, ticks) = stat_cpu_ticks(&stat, true)?;
    Some(ticks as f64 / USER_HZ as f64)
}

/// The postmaster of backend `pid` (what `pg_backend_pid()` answered),
/// when that backend runs on this machine: its process title names
/// `database`, which a process that merely has the same pid here does not.
pub fn postmaster_of_backend(pid: u32, database: &str) -> Option<u32> {
    let title = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    if !String::from_utf8_lossy(&title).contains(database) {
        return None;
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat_cpu_ticks(&stat, false).map(|(ppid, _)| ppid)
}

/// CPU seconds of this process's live threads, split into those whose name
/// starts with `prefix` and the rest (which includes the process's exited
/// threads).
pub fn own_seconds_split(prefix: &str) -> (f64, f64) {
    let total = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| stat_cpu_ticks(&s, false))
        .map_or(0, |(_, t)| t);
    let mut matching = 0;
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        for task in tasks.flatten() {
            let named = std::fs::read_to_string(task.path().join("comm"))
                .is_ok_and(|comm| comm.starts_with(prefix));
            if named
                && let Some((_, t)) = std::fs::read_to_string(task.path().join("stat"))
                    .ok()
                    .and_then(|s| stat_cpu_ticks(&s, false))
            {
                matching += t;
            }
        }
    }
    let hz = USER_HZ as f64;
    (
        matching as f64 / hz,
        total.saturating_sub(matching) as f64 / hz,
    )
}

#[cfg(test)]
mod tests {
    use super::stat_cpu_ticks;

    #[test]
    fn fields_are_counted_from_the_last_parenthesis() {
        let stat = "4242 (postgres: a (b) c) S 17 4242 4242 0 -1 4194560 900 0 0 0 \
                    120 30 7 3 20 0 1 0 100 0 0";
        assert_eq!(stat_cpu_ticks(stat, false), Some((17, 150)));
        assert_eq!(stat_cpu_ticks(stat, true), Some((17, 160)));
        assert_eq!(stat_cpu_ticks("garbage", false), None);
    }
}
