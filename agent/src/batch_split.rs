//! Cuts an interval's batch that would be too big to send into several.
//! A node with a thousand processes, each with a long command line, makes
//! a batch of megabytes; the collector decodes messages up to a limit
//! (16 MiB by default, 4 MiB at least, 4 MiB on older collectors), so the
//! agent keeps every batch under [`MAX_BATCH_BYTES`].
//!
//! Rules judge a GPU's memory against the processes on it from the same
//! batch, so a physical GPU (with its MIG instances) and its processes stay
//! in one part. Only a GPU whose own processes exceed the limit has them
//! spread over further parts.

use std::collections::HashMap;

use headroom_proto::v1 as pb;
use prost::Message;

/// Largest batch the agent sends: half of the smallest limit a collector
/// may set, so a batch fits with room for the message's own framing.
pub const MAX_BATCH_BYTES: usize = 2 << 20;

/// What a repeated field's element costs on the wire: its bytes, its tag
/// and its length prefix.
fn field_len(message_len: usize) -> usize {
    1 + prost::length_delimiter_len(message_len) + message_len
}

/// One physical GPU's share of a batch.
#[derive(Default)]
struct Group {
    gpu_samples: Vec<pb::GpuSample>,
    process_samples: Vec<pb::ProcessSample>,
    events: Vec<pb::Event>,
    bytes: usize,
}

/// Groups by physical GPU, in the order the batch first names them.
#[derive(Default)]
struct Groups {
    in_order: Vec<Group>,
    index: HashMap<String, usize>,
}

impl Groups {
    fn of(&mut self, parent_of: &HashMap<String, String>, uuid: &str) -> &mut Group {
        let key = parent_of.get(uuid).map_or(uuid, String::as_str);
        let at = match self.index.get(key) {
            Some(&at) => at,
            None => {
                self.in_order.push(Group::default());
                self.index.insert(key.to_owned(), self.in_order.len() - 1);
                self.in_order.len() - 1
            }
        };
        &mut self.in_order[at]
    }
}

/// `batch` as it is, when it fits `max_bytes`; otherwise parts that each
/// fit (unless a single sample is bigger), in order, with every sample and
/// event of `batch` in exactly one part. `parent_of` maps a MIG instance's
/// UUID to its GPU's.
pub fn split(
    batch: pb::Batch,
    parent_of: &HashMap<String, String>,
    max_bytes: usize,
) -> Vec<pb::Batch> {
    if batch.encoded_len() <= max_bytes {
        return vec![batch];
    }
    let empty = pb::Batch {
        node: batch.node.clone(),
        boot_id: batch.boot_id.clone(),
        seq: batch.seq,
        ..Default::default()
    };
    let envelope = empty.encoded_len();
    let budget = max_bytes.saturating_sub(envelope).max(1);
    let mut groups = Groups::default();
    for s in batch.gpu_samples {
        let group = groups.of(parent_of, &s.uuid);
        group.bytes += field_len(s.encoded_len());
        group.gpu_samples.push(s);
    }
    for p in batch.process_samples {
        let group = groups.of(parent_of, &p.uuid);
        group.bytes += field_len(p.encoded_len());
        group.process_samples.push(p);
    }
    for e in batch.events {
        let group = groups.of(parent_of, &e.uuid);
        group.bytes += field_len(e.encoded_len());
        group.events.push(e);
    }
    let mut parts = Vec::new();
    let mut part = empty.clone();
    let mut part_bytes = 0;
    for group in groups.in_order {
        if part_bytes + group.bytes > budget && part_bytes > 0 {
            parts.push(std::mem::replace(&mut part, empty.clone()));
            part_bytes = 0;
        }
        if part_bytes + group.bytes <= budget {
            part_bytes += group.bytes;
            part.gpu_samples.extend(group.gpu_samples);
            part.events.extend(group.events);
            part.process_samples.extend(group.process_samples);
            continue;
        }
        // A GPU too big for one part: its samples and events first, then
        // its processes in as many parts as they need.
        for s in group.gpu_samples {
            part_bytes += field_len(s.encoded_len());
            part.gpu_samples.push(s);
        }
        for e in group.events {
            part_bytes += field_len(e.encoded_len());
            part.events.push(e);
        }
        for p in group.process_samples {
            let len = field_len(p.encoded_len());
            if part_bytes + len > budget && part_bytes > 0 {
                parts.push(std::mem::replace(&mut part, empty.clone()));
                part_bytes = 0;
            }
            part_bytes += len;
            part.process_samples.push(p);
        }
    }
    if part_bytes > 0 || parts.is_empty() {
        parts.push(part);
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(uuid: &str) -> pb::GpuSample {
        pb::GpuSample {
            uuid: uuid.into(),
            timestamp_ms: 1_000,
            memory_total_bytes: 80 << 30,
            ..Default::default()
        }
    }

    fn process(uuid: &str, pid: u32, name_len: usize) -> pb::ProcessSample {
        pb::ProcessSample {
            uuid: uuid.into(),
            pid,
            timestamp_ms: 1_000,
            name: "x".repeat(name_len),
            ..Default::default()
        }
    }

    fn batch(gpus: usize, processes_per_gpu: usize, name_len: usize) -> pb::Batch {
        let uuids: Vec<String> = (0..gpus).map(|g| format!("GPU-{g}")).collect();
        pb::Batch {
            node: "node-a".into(),
            boot_id: "boot".into(),
            gpu_samples: uuids.iter().map(|u| gpu(u)).collect(),
            process_samples: uuids
                .iter()
                .flat_map(|u| {
                    (0..processes_per_gpu).map(move |p| process(u, p as u32 + 1, name_len))
                })
                .collect(),
            events: vec![pb::Event {
                uuid: "GPU-0".into(),
                kind: pb::EventKind::Xid.into(),
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    fn pids(parts: &[pb::Batch]) -> Vec<(String, u32)> {
        let mut all: Vec<_> = parts
            .iter()
            .flat_map(|b| b.process_samples.iter().map(|p| (p.uuid.clone(), p.pid)))
            .collect();
        all.sort();
        all
    }

    #[test]
    fn a_batch_that_fits_is_sent_as_it_is() {
        let small = batch(8, 4, 100);
        assert_eq!(
            split(small.clone(), &HashMap::new(), MAX_BATCH_BYTES),
            vec![small]
        );
    }

    #[test]
    fn a_thousand_long_command_lines_are_cut_under_the_limit_with_nothing_lost() {
        // 1,120 processes with 4 KB command lines: about 4.6 MB in one batch.
        let big = batch(8, 140, 4096);
        assert!(big.encoded_len() > 4 << 20);
        let parts = split(big.clone(), &HashMap::new(), MAX_BATCH_BYTES);
        assert!(parts.len() >= 3, "{} parts", parts.len());
        for part in &parts {
            assert!(
                part.encoded_len() <= MAX_BATCH_BYTES,
                "{}",
                part.encoded_len()
            );
            assert_eq!(part.node, "node-a");
            // Each GPU's sample travels with all of its processes.
            for g in &part.gpu_samples {
                let here = part
                    .process_samples
                    .iter()
                    .filter(|p| p.uuid == g.uuid)
                    .count();
                assert_eq!(here, 140, "GPU {} split from its processes", g.uuid);
            }
        }
        assert_eq!(pids(&parts), pids(std::slice::from_ref(&big)));
        let gpus: usize = parts.iter().map(|p| p.gpu_samples.len()).sum();
        let events: usize = parts.iter().map(|p| p.events.len()).sum();
        assert_eq!((gpus, events), (8, 1));
    }

    #[test]
    fn mig_instances_stay_with_their_gpu() {
        let mut big = batch(4, 100, 8000);
        big.gpu_samples.push(gpu("MIG-0a"));
        big.process_samples.push(process("MIG-0a", 9999, 10));
        let parent_of = HashMap::from([("MIG-0a".to_owned(), "GPU-0".to_owned())]);
        let parts = split(big, &parent_of, MAX_BATCH_BYTES);
        let with_gpu0 = parts
            .iter()
            .find(|p| p.gpu_samples.iter().any(|g| g.uuid == "GPU-0"))
            .unwrap();
        assert!(with_gpu0.gpu_samples.iter().any(|g| g.uuid == "MIG-0a"));
        assert!(with_gpu0.process_samples.iter().any(|p| p.pid == 9999));
    }

    #[test]
    fn one_gpu_with_more_processes_than_fit_spreads_them_over_parts() {
        let big = batch(1, 1000, 4096);
        let parts = split(big.clone(), &HashMap::new(), MAX_BATCH_BYTES);
        assert!(parts.len() >= 2);
        assert!(parts.iter().all(|p| p.encoded_len() <= MAX_BATCH_BYTES));
        assert_eq!(parts[0].gpu_samples.len(), 1);
        assert_eq!(pids(&parts), pids(&[big]));
    }
}
