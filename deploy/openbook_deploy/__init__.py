"""openbook's deployment commands (``openbook-secrets``), outside the core library: they run
in the gateway's image, where compose and the Kubernetes manifests start them."""
