//! What the person who owns a job can do about an alert, matched to the
//! signal that raised it. Short, concrete, and in the job's own terms: the
//! environment variable to set or the training technique to reach for.

const EXPANDABLE_SEGMENTS: &str = "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the job's \
     environment (PyTorch 2.1+): segments then grow in place instead of leaving freed blocks too small \
     for the next request.";

const CUT_THE_PEAK: &str = "Cut the job's peak memory: activation checkpointing \
     (torch.utils.checkpoint) on the largest blocks, bf16 autocast (torch.autocast(\"cuda\", \
     dtype=torch.bfloat16)), or smaller micro-batches with gradient accumulation to keep the \
     effective batch size.";

/// Memory the allocator holds beyond the job's peak need.
pub fn fragmentation(waste: u64, ratio: f64) -> String {
    format!(
        "The allocator holds {:.1} GiB ({:.0} % of what it reserved) more than the job's \
         tensors ever needed at once: freed blocks split too finely to reuse. Other processes \
         cannot use that memory, and large requests may still fail. {EXPANDABLE_SEGMENTS} \
         Calling torch.cuda.empty_cache() between phases (after evaluation) hands the cache back.",
        waste as f64 / f64::from(1u32 << 30),
        ratio * 100.0
    )
}

/// The allocator flushed its cache and retried `cudaMalloc`: the job is at
/// the edge of its memory.
pub fn alloc_retries(fragmented: bool) -> String {
    let mut text = format!(
        "Each retry frees the allocator's cache and stalls the step; the next failure is an \
         out-of-memory error. {CUT_THE_PEAK}"
    );
    if fragmented {
        text.push(' ');
        text.push_str("Much of the reservation is fragmented: ");
        text.push_str(EXPANDABLE_SEGMENTS);
    }
    text
}

/// The allocator raised out-of-memory errors.
pub fn allocator_oom(fragmented: bool) -> String {
    let mut text = format!("The job ran out of GPU memory. {CUT_THE_PEAK}");
    if fragmented {
        text.push_str(" The allocator held much more than it had allocated: ");
        text.push_str(EXPANDABLE_SEGMENTS);
    }
    text
}

/// Memory that grows step after step. When the allocator says live tensors
/// are flat and only its reservation grows, it is fragmentation instead.
pub fn leak(fragmentation_grows: bool) -> String {
    if fragmentation_grows {
        format!(
            "Live tensors are not what grows: the allocator's reservation is, through \
             fragmentation. {EXPANDABLE_SEGMENTS}"
        )
    } else {
        "Steady growth across steps usually means tensors kept alive across iterations: a loss \
         summed without .item() or .detach(), outputs or hidden states appended to a list, a \
         cache or hook holding references. Compare torch.cuda.memory_snapshot() between two \
         steps to find what stays."
            .to_owned()
    }
}

/// A GPU heading for out-of-memory.
pub fn time_to_oom() -> String {
    format!("If a training job is the one growing: {CUT_THE_PEAK}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_signal_names_its_remedy() {
        assert!(fragmentation(3 << 30, 0.4).contains("expandable_segments:True"));
        assert!(
            fragmentation(3 << 30, 0.4).contains("3.0 GiB (40 % of what it reserved)"),
            "{}",
            fragmentation(3 << 30, 0.4)
        );
        assert!(alloc_retries(false).contains("activation checkpointing"));
        assert!(!alloc_retries(false).contains("expandable_segments"));
        assert!(alloc_retries(true).contains("expandable_segments"));
        assert!(allocator_oom(false).contains("gradient accumulation"));
        assert!(leak(false).contains("tensors kept alive across iterations"));
        assert!(leak(true).contains("expandable_segments"));
        assert!(time_to_oom().contains("bf16 autocast"));
    }
}
