"""HTTP layer: quart-trio app, OpenAI routes, SSE, health, metrics. Maps errors to HTTP statuses."""
