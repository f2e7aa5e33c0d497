"""What users call: ``fully_shard`` and ``FSDPModule`` (``fully_shard``), their comm setters
(``comm_api``), ``auto_shard`` (groups the planner chooses), the policy classes
(``policies``), errors and argument checks (``errors``), and the entry fsdp-rs keeps in
torch's composable registry (``composable``).
"""
