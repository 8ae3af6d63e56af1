"""The product surface: config models, Serve application, OpenAI ingress, CLI, benchmarks."""
