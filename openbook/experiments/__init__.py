"""The RAG paper's experiments, reproduced in small on the demo data (docs/results.md)."""
