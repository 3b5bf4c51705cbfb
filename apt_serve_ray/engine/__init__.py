"""The engine: offline API, LLMEngine, the serving core, its process and async client, outputs."""
