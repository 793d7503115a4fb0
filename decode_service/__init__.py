"""The decode service: OpenAI-compatible HTTP front door, KV receiver and speculative decoding engine."""
