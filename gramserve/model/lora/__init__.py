"""LoRA adapters in the model: PEFT files read and checked (adapter.py), the device pool of adapter slots
(pool.py), the per-batch segments (batch.py), and the segmented matmuls that add each row's adapter to a
projection (compute.py: torch; triton_ops.py: the GPU kernel), applied by LoRALinear (linear.py)."""
