-- What a training process's client counted in its own tensors (issue 28):
-- resident bytes of weights, gradients and optimizer state, with each
-- report, NULL where it was not counted (a client given no model or no
-- optimizer, and every report from before this release). Activations and
-- cache follow from the allocator figures already stored.
ALTER TABLE allocator_samples ADD COLUMN weights BIGINT;
ALTER TABLE allocator_samples ADD COLUMN gradients BIGINT;
ALTER TABLE allocator_samples ADD COLUMN optimizer_state BIGINT;

-- The newest count on the process's row, with the dtype holding most of
-- each part (the dtype changes no chart, only the advice).
ALTER TABLE processes ADD COLUMN alloc_weights BIGINT;
ALTER TABLE processes ADD COLUMN alloc_weights_dtype TEXT;
ALTER TABLE processes ADD COLUMN alloc_gradients BIGINT;
ALTER TABLE processes ADD COLUMN alloc_gradients_dtype TEXT;
ALTER TABLE processes ADD COLUMN alloc_optimizer_state BIGINT;
ALTER TABLE processes ADD COLUMN alloc_optimizer_state_dtype TEXT;
