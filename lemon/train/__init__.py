"""Training the orchestrator (paper §3.3): configs and profiles (`config`), the policy model (`policy`), the SFT warm
start (`sft`), counterfactual edits (`edits`), reward terms (`rewards`), (B, T) CF advantages (`cf`), the CF-GRPO
trainer (`grpo`) and the two-stage pipeline (`pipeline`)."""
