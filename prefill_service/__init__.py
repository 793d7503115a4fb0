"""The prefill service: a gRPC leader driving pipeline-parallel stage processes that each push their layers' packed
state to the decode service over Mooncake."""
