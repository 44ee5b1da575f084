"""Engine integrations (vLLM, transformers). Each imports its engine lazily."""
