"""Host agent: one per machine; forks ranks from a warm template, reaps them, fans out."""
