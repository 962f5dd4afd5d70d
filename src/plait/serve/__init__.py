"""``plait serve``: an OpenAI-compatible HTTP server with continuous batching over a TP x PP model."""
