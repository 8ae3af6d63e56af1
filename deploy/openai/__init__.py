"""The OpenAI-compatible HTTP surface: schema, request checks, prompts, the service logic,
responses and SSE, and the FastAPI ingress deployment."""
