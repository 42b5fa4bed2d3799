"""Client fronts of the router: the OpenAI-compatible HTTP API and the dspark.v1.Router gRPC service."""
