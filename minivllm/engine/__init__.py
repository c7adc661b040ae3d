"""The engine loop (LLMEngine), the offline API (LLM) and the step trace the notebooks draw."""
