//! What one poll of the NVML source costs: wall time per poll (median, p99)
//! and CPU time per poll, with attribution from a procfs tree.
//!
//! ```text
//! HEADROOM_FAKE_NVML_SCENARIO=fake-nvml/scenarios/bench-8x50.toml \
//!   cargo run --release -p headroom-agent --example poll_cost -- \
//!   target/release/libnvidia_ml.so /tmp/bench-proc 2000
//! ```
//!
//! Polls back to back, so the figure is the source's own cost, not the
//! sampler's sleep. Used by `bench/agent_cost.py`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use headroom_agent::source::{GpuSource, NvmlOptions, NvmlSource};

fn cpu_seconds() -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    let after_comm = stat.rsplit_once(')').context("odd /proc/self/stat")?.1;
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after comm.
    let ticks: u64 = fields.get(11).context("utime")?.parse::<u64>()?
        + fields.get(12).context("stime")?.parse::<u64>()?;
    Ok(ticks as f64 / 100.0)
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let library = PathBuf::from(
        args.next()
            .context("usage: poll_cost LIBRARY PROCFS [POLLS]")?,
    );
    let procfs = PathBuf::from(
        args.next()
            .context("usage: poll_cost LIBRARY PROCFS [POLLS]")?,
    );
    let polls: usize = args.next().map_or(Ok(2000), |n| n.parse())?;
    let mut source = NvmlSource::new(NvmlOptions {
        library: Some(library),
        procfs_root: procfs,
        poll_wait: Duration::from_millis(80),
        ..NvmlOptions::default()
    })?;
    let inventory = source.inventory()?;
    // Warm-up: layouts, attribution cache, first PCIe deltas.
    for _ in 0..20 {
        source.poll()?;
    }
    let mut walls = Vec::with_capacity(polls);
    let (mut devices, mut processes) = (0, 0);
    let cpu_before = cpu_seconds()?;
    for _ in 0..polls {
        let started = Instant::now();
        let poll = source.poll()?;
        walls.push(started.elapsed());
        devices = poll.devices.len();
        processes = poll.processes.len();
    }
    let cpu = cpu_seconds()? - cpu_before;
    walls.sort();
    let at = |q: f64| walls[((walls.len() as f64 - 1.0) * q).round() as usize];
    println!(
        "gpus={} devices_per_poll={devices} processes_per_poll={processes} polls={polls}",
        inventory.gpus.len()
    );
    println!(
        "poll wall: median {} us, p99 {} us",
        at(0.5).as_micros(),
        at(0.99).as_micros()
    );
    println!(
        "poll cpu: {:.1} us per poll (all threads)",
        cpu * 1e6 / polls as f64
    );
    Ok(())
}
