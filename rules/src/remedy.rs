//! Advice that several rules' remedies share. A remedy tells the person who
//! owns a job what to do about an alert, in the job's own terms: the
//! environment variable to set or the training technique to reach for. Each
//! rule writes its own remedy in its file; the paragraphs here are the ones
//! more than one of them ends in, kept word for word alike so that a job
//! raising two alerts does not read two versions of the same advice.

/// For memory the caching allocator holds but cannot reuse.
pub(crate) const EXPANDABLE_SEGMENTS: &str = "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the job's \
     environment (PyTorch 2.1+): segments then grow in place instead of leaving freed blocks too small \
     for the next request.";

/// For a job whose peak does not fit.
pub(crate) const CUT_THE_PEAK: &str = "Cut the job's peak memory: activation checkpointing \
     (torch.utils.checkpoint) on the largest blocks, bf16 autocast (torch.autocast(\"cuda\", \
     dtype=torch.bfloat16)), or smaller micro-batches with gradient accumulation to keep the \
     effective batch size.";
