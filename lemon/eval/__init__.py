"""Methods and their evaluation: baselines as specs (`baselines`), the orchestrator prompt and spec writers
(`orchestrator`), the resumable eval runner (`runner`)."""
