"""Serving plumbing shared by the gRPC services: server start-up, errors, batching."""
