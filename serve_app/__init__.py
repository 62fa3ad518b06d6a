"""The Ray Serve front end: an OpenAI-compatible HTTP API and the gRPC service of
`protos/powerinfer/v1/inference.proto`, over one engine handle per served model."""
