"""Serving plumbing shared by the services: start-up (every service's, the gateway's too), gRPC
server start-up, errors, batching, and the health probe every image runs (``health``,
``openbook-health``)."""
