"""What the ranks must agree on: the plans, once at lazy init (``plan_check``), the
trainable set and gradients present, once per backward (``agreement``), and optimizers
built before ``fully_shard`` (``optimizer_check``).
"""
