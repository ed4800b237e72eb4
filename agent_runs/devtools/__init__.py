"""Development tools: the embedded PostgreSQL, the demo and the scripted agent (not the API)."""
