"""gRPC contract between the decode and prefill services (generated stubs beside prefill.proto)."""
