"""The GRPO loss: its options (GRPOLossConfig), the per-token math, the eager fp64-checkable reference, the fused
loss through the lm_head and the model-level loss."""
