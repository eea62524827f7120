"""blockspec's request path and orchestration."""
