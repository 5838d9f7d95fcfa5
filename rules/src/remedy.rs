//! Advice that several rules' remedies share. A remedy tells the person who
//! owns a job what to do about an alert, in the job's own terms: the
//! environment variable to set or the training technique to reach for. Each
//! rule writes its own remedy in its file; the paragraphs here are the ones
//! more than one of them ends in, kept word for word alike so that a job
//! raising two alerts does not read two versions of the same advice.
//! Where the job says what its memory holds, the remedy that fits the
//! largest share leads (`for_largest_share`).

use headroom_common::{ApproxBytes, Breakdown, Dtype, Share};

/// For memory the caching allocator holds but cannot reuse.
pub(crate) const EXPANDABLE_SEGMENTS: &str = "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the job's \
     environment (PyTorch 2.1+): segments then grow in place instead of leaving freed blocks too small \
     for the next request.";

/// For a job whose peak does not fit.
pub(crate) const CUT_THE_PEAK: &str = "Cut the job's peak memory: activation checkpointing \
     (torch.utils.checkpoint) on the largest blocks, bf16 autocast (torch.autocast(\"cuda\", \
     dtype=torch.bfloat16)), or smaller micro-batches with gradient accumulation to keep the \
     effective batch size.";

/// The remedy for the largest share when the job counts its parts,
/// otherwise `general`.
pub(crate) fn fitting_the_largest_share(breakdown: Option<&Breakdown>, general: &str) -> String {
    breakdown
        .and_then(for_largest_share)
        .unwrap_or_else(|| general.to_owned())
}

/// Whether the remedy that fits leads with the allocator's cache already, so
/// that a rule does not add the same advice a second time.
pub(crate) fn leads_with_cache(breakdown: Option<&Breakdown>) -> bool {
    breakdown
        .and_then(Breakdown::largest)
        .is_some_and(|(share, _, _)| share == Share::Cache)
}

/// The remedy for the largest share of a process's or a job's memory at its
/// peak, led by the figure: `None` when nothing was counted. The texts name
/// the PyTorch knobs exactly, for the job's owner to act on.
pub fn for_largest_share(b: &Breakdown) -> Option<String> {
    let (share, bytes, fraction) = b.largest()?;
    let dtype = match share {
        Share::Weights => b.weights_dtype,
        Share::Gradients => b.gradients_dtype,
        _ => None,
    };
    // Floored: a share short of all of it never reads 100 %.
    let figure = format!(
        "{}{}, {:.0} % of the peak",
        ApproxBytes(bytes),
        dtype.map_or(String::new(), |d| format!(" in {}", d.as_str())),
        (fraction * 100.0).floor()
    );
    let full_precision = dtype.is_some_and(Dtype::is_full_precision);
    Some(match share {
        Share::Weights if full_precision => format!(
            "Weights are {figure}: keeping them in bf16 (model.to(torch.bfloat16), with the \
             optimizer's own fp32 copy where precision needs it) halves them and their gradients; \
             FSDP (torch.distributed.fsdp.fully_shard) puts 1/N of them on each of N GPUs."
        ),
        Share::Weights => format!(
            "Weights are {figure}: FSDP (torch.distributed.fsdp.fully_shard) or tensor \
             parallelism puts 1/N of them on each of N GPUs; for fine-tuning with adapters, \
             frozen weights quantised to 8 or 4 bits (bitsandbytes) take a half or a quarter."
        ),
        Share::Gradients => format!(
            "Gradients are {figure}: FSDP or DeepSpeed ZeRO stage 2 puts 1/N of them on each of \
             N GPUs; layers that are not trained need none (requires_grad_(False)); \
             optimizer.zero_grad(set_to_none=True) frees them between steps{}.",
            if full_precision {
                "; in bf16 they take half the bytes"
            } else {
                ""
            }
        ),
        Share::OptimizerState => format!(
            "Optimizer state is {figure}: a sharded optimizer would put 1/N of it on each of N \
             GPUs (torch.distributed.optim.ZeroRedundancyOptimizer, FSDP, or DeepSpeed ZeRO \
             stage 1 or 2); an 8-bit optimizer (bitsandbytes.optim.AdamW8bit) keeps Adam's two \
             moments in a quarter of their fp32 bytes."
        ),
        Share::Activations => format!(
            "Activations and temporaries are {figure}: activation checkpointing \
             (torch.utils.checkpoint.checkpoint on the largest blocks, or \
             model.gradient_checkpointing_enable() in Hugging Face Transformers) recomputes them \
             instead of keeping them; smaller micro-batches with gradient accumulation keep the \
             effective batch size; bf16 autocast (torch.autocast(\"cuda\", dtype=torch.bfloat16)) \
             halves those kept in fp32."
        ),
        Share::Cache => format!(
            "The allocator's cache holds {figure} beyond the most its tensors ever needed: \
             {EXPANDABLE_SEGMENTS}"
        ),
        Share::OutsideAllocator => format!(
            "Memory outside PyTorch's allocator is {figure}: the CUDA context, cuBLAS and cuDNN \
             workspaces, NCCL buffers and any other library on the GPU. CUDA_MODULE_LOADING=LAZY \
             (the default from CUDA 12.2) loads kernels only when first used; NCCL_BUFFSIZE sets \
             NCCL's buffer per channel; a second framework in the process keeps its own pool \
             (JAX: XLA_PYTHON_CLIENT_PREALLOCATE=false)."
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_common::composition::AllocatorFigures;
    use headroom_common::{Composition, Part};

    const GIB: u64 = 1 << 30;

    fn breakdown(
        weights: (u64, Dtype),
        gradients: u64,
        optimizer: Option<u64>,
        peak: u64,
    ) -> Breakdown {
        let part = |bytes, dtype| Some(Part { bytes, dtype });
        Breakdown::of(
            &Composition {
                weights: part(weights.0, weights.1),
                gradients: part(gradients, weights.1),
                optimizer_state: optimizer.and_then(|o| part(o, Dtype::Float32)),
            },
            AllocatorFigures {
                allocated: peak,
                reserved: peak + GIB,
                peak_allocated: peak,
            },
            Some(peak + 2 * GIB),
        )
    }

    #[test]
    fn the_largest_share_picks_the_remedy_and_leads_with_its_figure() {
        let adam = breakdown(
            (7 * GIB, Dtype::Bfloat16),
            7 * GIB,
            Some(28 * GIB),
            66 * GIB,
        );
        let text = for_largest_share(&adam).unwrap();
        assert!(
            text.starts_with("Optimizer state is 28 GiB, 41 % of the peak: a sharded optimizer"),
            "{text}"
        );
        assert!(text.contains("ZeroRedundancyOptimizer"));

        let fp32 = breakdown(
            (20 * GIB, Dtype::Float32),
            20 * GIB,
            Some(4 * GIB),
            60 * GIB,
        );
        let text = for_largest_share(&fp32).unwrap();
        assert!(
            text.starts_with("Weights are 20 GiB in float32, "),
            "{text}"
        );
        assert!(text.contains("model.to(torch.bfloat16)"), "{text}");

        let lora = breakdown((10 * GIB, Dtype::Bfloat16), GIB, Some(GIB), 60 * GIB);
        let text = for_largest_share(&lora).unwrap();
        assert!(
            text.starts_with("Activations and temporaries are 48 GiB"),
            "{text}"
        );
        assert!(text.contains("torch.utils.checkpoint"));
    }

    #[test]
    fn without_the_optimizer_counted_the_rest_of_the_peak_is_not_called_activations() {
        let b = breakdown((10 * GIB, Dtype::Bfloat16), GIB, None, 60 * GIB);
        let text = for_largest_share(&b).unwrap();
        assert!(
            text.starts_with("Weights are 10 GiB in bfloat16, 16 % of the peak"),
            "{text}"
        );
        assert!(text.contains("fully_shard"));
    }
}
